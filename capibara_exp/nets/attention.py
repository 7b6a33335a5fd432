"""Causal self-attention with grouped key/value heads, and its decoding cache.

`DecoderConfig.attention` picks the implementation:

- `dot`: einsums and a softmax over the full [B, H, L, S] scores, on every platform. It is
  the reference: relative position bias, prefix-LM masks, sliding windows, soft-capped
  scores and attention dropout all work, and decoding always runs it.
- `splash`: `jax.experimental.pallas.ops.tpu.splash_attention` (nets/splash.py) when the
  step is lowered for a TPU, `dot` elsewhere.

Grouped-query attention: `num_kv_heads` key/value heads, each shared by num_heads /
num_kv_heads consecutive query heads (query head h reads key/value head h // group).

Decoding follows T5X's convention (its `DecoderOnlyModel.predict_batch` drives it): with
`decode=True` the first call creates the 'cache' collection (`cached_key`, `cached_value`:
[B, KV heads, K, S], and `cache_index`); `prefill=True` fills it with a whole prompt at once
(positions below `prefill_lengths`); then each `decode=True` call takes one token per row,
writes its key and value at the row's `cache_index` and attends to every cached position
up to it.

Shape suffixes as in nets/decoder.py, plus G key/value heads and R query heads per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

from capibara_exp.base import logical_axes as axes
from capibara_exp.nets import splash
from capibara_exp.nets.layers import Dense, RMSNorm, constrain, dropout, softcap
from capibara_exp.nets.positions import rotate
from capibara_exp.nets.remat import checkpoint_name

CACHE_AXES = ("batch", "kv_heads", "kv", "length")  # of cached_key / cached_value


def dot_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_Bx1xLxS, bias_BxHxLxS=None, *,
                  scale: float | None = None, cap: float | None = None,
                  probs_dropout=lambda p: p):
    """Softmax(q k^T * scale, soft-capped, + bias) v with float32 scores; masked scores get
    float32's minimum. Query heads are grouped over the key/value heads."""
    dtype = q_BxLxHxK.dtype
    b, length, h, k = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, length, g, h // g, k)
    scores = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK,
                        preferred_element_type=jnp.float32)
    if scale is not None:
        scores = scores * scale
    scores = softcap(scores, cap)
    if bias_BxHxLxS is not None:
        scores = scores + bias_BxHxLxS.reshape(bias_BxHxLxS.shape[0], g, h // g,
                                               *bias_BxHxLxS.shape[2:])
    scores = jnp.where(mask_Bx1xLxS[:, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = probs_dropout(jax.nn.softmax(scores, axis=-1).astype(dtype))
    out = jnp.einsum("bgrls,bsgk->blgrk", probs, v_BxSxGxK)
    return out.reshape(b, length, h, k)


def window_mask(query_positions_BxL, key_positions_BxS, window: int) -> jnp.ndarray:
    """[B, 1, L, S]: keys fewer than `window` positions behind the query."""
    behind = query_positions_BxL[:, :, None] - key_positions_BxS[:, None, :]
    return (behind < window)[:, None]


class Attention(nn.Module):
    """Causal self-attention with T5X's projection names and logical axes."""

    config: object  # nets.DecoderConfig (nets.config imports nets.positions, not this)
    local: bool = False  # a sliding-window layer

    def project(self, x_BxLxD, name: str, heads: int, init_scale: float = 1.0):
        c = self.config
        y = Dense(heads * c.head_dim, ("embed", "joined_kv"), c.compute_dtype, init_scale,
                  "normal", use_bias=c.qkv_bias, name=name)(x_BxLxD)
        return y.reshape(y.shape[:2] + (heads, c.head_dim))

    def qkv(self, x_BxLxD, positions_BxL):
        """Queries, keys and values of the tokens, normed and rotated as configured."""
        c = self.config
        # T5 scales scores by 1/sqrt(head_dim) through the query's initialisation instead.
        t5_scale = 1.0 / c.head_dim if c.query_pre_attn_scalar is None else 1.0
        q = checkpoint_name(self.project(x_BxLxD, "query", c.num_heads, t5_scale), "query_proj")
        k = checkpoint_name(self.project(x_BxLxD, "key", c.kv_heads), "key_proj")
        v = checkpoint_name(self.project(x_BxLxD, "value", c.kv_heads), "value_proj")
        if c.qk_norm:
            norm = dict(epsilon=c.norm_epsilon, plus_one=c.norm_scale_plus_one, axis_name="kv")
            q = RMSNorm(c.compute_dtype, name="query_norm", **norm)(q)
            k = RMSNorm(c.compute_dtype, name="key_norm", **norm)(k)
        if c.position_embedding == "rope":
            inv_freq = c.rope_frequencies(self.local)
            q, k = rotate(q, positions_BxL, inv_freq), rotate(k, positions_BxL, inv_freq)
        q = constrain(q, axes.QUERY)
        k = constrain(k, axes.KEY_VALUE)
        v = constrain(v, axes.KEY_VALUE)
        return q, k, v

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout,
                 segments_BxL=None, decode: bool = False, prefill: bool = False,
                 prefill_lengths=None):
        c = self.config
        step = decode and self.has_variable("cache", "cached_key") and not prefill
        if step:  # one new token per row, at the row's cache index
            positions_BxL = jnp.reshape(self.get_variable("cache", "cache_index"), (-1, 1))
            positions_BxL = jnp.broadcast_to(positions_BxL, (x_BxLxD.shape[0], 1))
        q, k, v = self.qkv(x_BxLxD, positions_BxL)
        if decode or prefill:
            k, v, mask_Bx1xLxS, bias_BxHxLxS = self.cached(
                k, v, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, step, prefill, prefill_lengths)
        elif self.local:
            mask_Bx1xLxS = mask_Bx1xLxS & window_mask(positions_BxL, positions_BxL,
                                                      c.sliding_window)
        scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5

        def dot(q, k, v):
            return dot_attention(q, k, v, mask_Bx1xLxS, bias_BxHxLxS, scale=scale,
                                 cap=c.attn_logit_softcap,
                                 probs_dropout=lambda p: dropout(p, c.dropout_rate,
                                                                 enable_dropout))

        if c.attention == "splash" and not (decode or prefill):
            out_BxLxHxK = splash.attention(q, k, v, segments_BxL, dot, scale=scale,
                                           cap=c.attn_logit_softcap,
                                           window=c.sliding_window if self.local else None,
                                           block=c.splash_block, fused_bwd=c.splash_fused_bwd)
        else:
            out_BxLxHxK = dot(q, k, v)
        out_BxLxHK = checkpoint_name(out_BxLxHxK.reshape(out_BxLxHxK.shape[:2] + (-1,)),
                                     "context")
        return checkpoint_name(Dense(c.emb_dim, ("joined_kv", "embed"), c.compute_dtype,
                                     distribution="normal", name="out")(out_BxLxHK), "out_proj")

    def cached(self, k_BxLxGxK, v_BxLxGxK, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL,
               step: bool, prefill: bool, prefill_lengths):
        """Keys, values, mask and bias to attend with, through the cache (see the module
        doc): created on the first call, filled by a prefill, one position per step."""
        shape = lambda x: x.shape[:1] + x.shape[2:] + x.shape[1:2]  # noqa: E731 [B, G, K, S]
        cache = {name: nn_partitioning.variable_with_axes(
            "cache", f"cached_{name}", jnp.zeros, shape(x), x.dtype, axes=CACHE_AXES)
            for name, x in (("key", k_BxLxGxK), ("value", v_BxLxGxK))}
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if step:
            return self.step(cache, index, k_BxLxGxK, v_BxLxGxK, mask_Bx1xLxS, bias_BxHxLxS,
                             positions_BxL)
        if prefill:  # the prompt's positions below each row's length
            if prefill_lengths is None:
                prefill_lengths = jnp.sum(mask_Bx1xLxS[:, 0, 0, :], axis=-1)
            keep_BxS = jnp.arange(k_BxLxGxK.shape[1])[None] < prefill_lengths[:, None]
            for name, x in (("key", k_BxLxGxK), ("value", v_BxLxGxK)):
                cache[name].value = jnp.moveaxis(x, 1, -1) * keep_BxS[:, None, None].astype(
                    x.dtype)
            index.value = prefill_lengths.astype(jnp.int32)
        # creation or prefill: attention over the tokens themselves, as in training
        if self.local:
            mask_Bx1xLxS = mask_Bx1xLxS & window_mask(positions_BxL, positions_BxL,
                                                      self.config.sliding_window)
        return k_BxLxGxK, v_BxLxGxK, mask_Bx1xLxS, bias_BxHxLxS

    def step(self, cache, index, k_Bx1xGxK, v_Bx1xGxK, mask_Bx1x1x1, bias_BxHxLxS, at_Bx1):
        """Write one token's key and value at each row's index `at_Bx1` and attend to every
        cached position up to it (within the window in a local layer)."""
        length = cache["key"].value.shape[-1]
        onehot_BxS = jax.nn.one_hot(at_Bx1[:, 0], length, dtype=k_Bx1xGxK.dtype)
        for name, x in (("key", k_Bx1xGxK), ("value", v_Bx1xGxK)):
            cache[name].value = cache[name].value + (jnp.moveaxis(x, 1, -1)
                                                     * onehot_BxS[:, None, None])
        index.value = index.value + 1
        key_positions_BxS = jnp.broadcast_to(jnp.arange(length)[None], (at_Bx1.shape[0], length))
        mask = (key_positions_BxS <= at_Bx1)[:, None, None, :] & mask_Bx1x1x1
        if self.local:
            mask = mask & window_mask(at_Bx1, key_positions_BxS, self.config.sliding_window)
        if bias_BxHxLxS is not None:  # the query's row of a [max length]^2 bias
            rows_BxL = jax.nn.one_hot(at_Bx1[:, 0], bias_BxHxLxS.shape[2],
                                      dtype=bias_BxHxLxS.dtype)
            bias = jnp.broadcast_to(bias_BxHxLxS, (at_Bx1.shape[0], *bias_BxHxLxS.shape[1:]))
            bias_BxHxLxS = jnp.einsum("bq,bhqk->bhk", rows_BxL, bias)[:, :, None]
        keys = lambda name: jnp.moveaxis(cache[name].value, -1, 1)  # noqa: E731
        return keys("key"), keys("value"), mask, bias_BxHxLxS
