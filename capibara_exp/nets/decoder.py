"""A T5-style decoder-only Transformer with T5X's decoder call signature and logical axes.

Pre-norm blocks (RMSNorm -> causal self-attention, RMSNorm -> gated-GELU MLP), T5
relative position bias or rotary embeddings, packing through segment ids and positions,
prefix-LM through `decoder_causal_attention`. Parameters are float32 and carry T5X's
logical axis names (the 'params_axes' collection), so `models.DecoderOnlyModel.module =
@nets.Decoder()` works in real T5X and in the local runtime alike.

Shape suffixes: B batch, L length (query), S length (key), D embed, H heads, K head dim,
F mlp, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

param_with_axes = nn_partitioning.param_with_axes
constrain = nn_partitioning.with_sharding_constraint

_ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "linear": lambda x: x}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_POSITIONS = ("relative", "rope")
_REMAT = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of the decoder; gin configures it (nets.DecoderConfig.emb_dim = 64)."""

    vocab_size: int
    emb_dim: int
    num_heads: int
    head_dim: int
    num_layers: int
    mlp_dim: int
    mlp_activations: Sequence[str] = ("gelu", "linear")
    dropout_rate: float = 0.0
    dtype: str = "float32"
    position_embedding: str = "relative"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    rope_max_wavelength: float = 10_000.0
    logits_via_embedding: bool = False
    remat_policy: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
        for name in ("vocab_size", "emb_dim", "num_heads", "head_dim", "num_layers", "mlp_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DecoderConfig.{name} must be positive, got {getattr(self, name)}")
        _check_choice("mlp_activations", self.mlp_activations, _ACTIVATIONS)
        _check_choice("dtype", (self.dtype,), _DTYPES)
        _check_choice("position_embedding", (self.position_embedding,), _POSITIONS)
        _check_choice("remat_policy", (self.remat_policy,), _REMAT)
        if not self.mlp_activations:
            raise ValueError("DecoderConfig.mlp_activations must name at least one activation")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"DecoderConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even for rope, got {self.head_dim}")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.dtype]


def _check_choice(field: str, values: Sequence[str], allowed) -> None:
    for value in values:
        if value not in allowed:
            raise ValueError(f"DecoderConfig.{field}: '{value}' is not one of {sorted(allowed)}")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (T5's LayerNorm)."""

    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxLxD: jnp.ndarray) -> jnp.ndarray:
        x = x_BxLxD.astype(jnp.float32)
        var_BxLx1 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        scale_D = param_with_axes("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32,
                                  axes=("embed",))
        return (x * jax.lax.rsqrt(var_BxLx1 + self.epsilon) * scale_D).astype(self.dtype)


def _dense(module: nn.Module, name: str, x: jnp.ndarray, shape: tuple[int, int],
           axes: tuple[str, str], dtype: jnp.dtype, scale: float = 1.0) -> jnp.ndarray:
    init = nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
    kernel = param_with_axes(name, init, shape, jnp.float32, axes=axes, module=module)
    return jnp.einsum("...d,df->...f", x.astype(dtype), kernel.astype(dtype))


def relative_position_buckets(relative_SxS: jnp.ndarray, num_buckets: int, max_distance: int
                              ) -> jnp.ndarray:
    """T5's causal bucketing of (key - query) positions: exact when near, log-spaced when far."""
    distance = jnp.maximum(-relative_SxS, 0)  # causal: only the past carries information
    exact = num_buckets // 2
    is_small = distance < exact
    log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return jnp.where(is_small, distance, large)


def rotate(x_BxLxHxK: jnp.ndarray, positions_BxL: jnp.ndarray, max_wavelength: float) -> jnp.ndarray:
    """Rotary position embedding of queries or keys (half-split pairing)."""
    half = x_BxLxHxK.shape[-1] // 2
    freq_K2 = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxLx1xK2 = positions_BxL[:, :, None, None].astype(jnp.float32) * freq_K2
    sin, cos = jnp.sin(angle_BxLx1xK2), jnp.cos(angle_BxLx1xK2)
    x = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_1xHxLxS, positions_BxL, enable_dropout):
        c = self.config
        dtype = c.compute_dtype
        hk = c.num_heads * c.head_dim
        # T5 folds 1/sqrt(head_dim) into the query initialisation instead of the logits.
        q = _dense(self, "query", x_BxLxD, (c.emb_dim, hk), ("embed", "joined_kv"), dtype,
                   scale=1.0 / c.head_dim)
        k = _dense(self, "key", x_BxLxD, (c.emb_dim, hk), ("embed", "joined_kv"), dtype)
        v = _dense(self, "value", x_BxLxD, (c.emb_dim, hk), ("embed", "joined_kv"), dtype)
        split = lambda t: t.reshape(t.shape[:2] + (c.num_heads, c.head_dim))  # noqa: E731
        q_BxLxHxK, k_BxSxHxK, v_BxSxHxK = split(q), split(k), split(v)
        if c.position_embedding == "rope":
            q_BxLxHxK = rotate(q_BxLxHxK, positions_BxL, c.rope_max_wavelength)
            k_BxSxHxK = rotate(k_BxSxHxK, positions_BxL, c.rope_max_wavelength)
        logits_BxHxLxS = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK).astype(jnp.float32)
        if bias_1xHxLxS is not None:
            logits_BxHxLxS = logits_BxHxLxS + bias_1xHxLxS
        logits_BxHxLxS = jnp.where(mask_Bx1xLxS, logits_BxHxLxS, jnp.finfo(jnp.float32).min)
        probs_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1).astype(dtype)
        probs_BxHxLxS = nn.Dropout(c.dropout_rate)(probs_BxHxLxS, deterministic=not enable_dropout)
        out_BxLxHxK = jnp.einsum("bhls,bshk->blhk", probs_BxHxLxS, v_BxSxHxK)
        out_BxLxHK = out_BxLxHxK.reshape(out_BxLxHxK.shape[:2] + (hk,))
        return _dense(self, "out", out_BxLxHK, (hk, c.emb_dim), ("joined_kv", "embed"), dtype)


class Mlp(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BxLxD, enable_dropout):
        c = self.config
        dtype = c.compute_dtype
        h_BxLxF = None
        for i, act in enumerate(c.mlp_activations):
            name = "wi" if len(c.mlp_activations) == 1 else f"wi_{i}"
            branch = _ACTIVATIONS[act](_dense(self, name, x_BxLxD, (c.emb_dim, c.mlp_dim),
                                              ("embed", "mlp"), dtype))
            h_BxLxF = branch if h_BxLxF is None else h_BxLxF * branch
        h_BxLxF = constrain(h_BxLxF, ("batch", "length", "mlp"))
        h_BxLxF = nn.Dropout(c.dropout_rate)(h_BxLxF, deterministic=not enable_dropout)
        return _dense(self, "wo", h_BxLxF, (c.mlp_dim, c.emb_dim), ("mlp", "embed"), dtype)


class DecoderLayer(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_1xHxLxS, positions_BxL, enable_dropout):
        c = self.config
        drop = nn.Dropout(c.dropout_rate)
        h = RMSNorm(dtype=c.compute_dtype, name="pre_self_attention_layer_norm")(x_BxLxD)
        h = Attention(c, name="self_attention")(h, mask_Bx1xLxS, bias_1xHxLxS, positions_BxL,
                                                enable_dropout)
        x_BxLxD = x_BxLxD + drop(h, deterministic=not enable_dropout)
        h = RMSNorm(dtype=c.compute_dtype, name="pre_mlp_layer_norm")(x_BxLxD)
        h = Mlp(c, name="mlp")(h, enable_dropout)
        x_BxLxD = x_BxLxD + drop(h, deterministic=not enable_dropout)
        return constrain(x_BxLxD, ("batch", "length", "embed"))


def attention_mask(segments_BxL, causal_attention_BxL) -> jnp.ndarray:
    """[B, 1, L, S] booleans: causal (or bidirectional inside the prefix), same segment only."""
    length = segments_BxL.shape[1]
    causal_LxS = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    mask_BxLxS = jnp.broadcast_to(causal_LxS, segments_BxL.shape + (length,))
    if causal_attention_BxL is not None:
        prefix_BxL = causal_attention_BxL.astype(bool)
        mask_BxLxS = mask_BxLxS | (prefix_BxL[:, :, None] & prefix_BxL[:, None, :])
    same_BxLxS = segments_BxL[:, :, None] == segments_BxL[:, None, :]
    return (mask_BxLxS & same_BxLxS)[:, None]


class Decoder(nn.Module):
    """The network: tokens in, float32 logits [batch, length, vocab] out."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, decoder_input_tokens, decoder_target_tokens, decoder_segment_ids=None,
                 decoder_positions=None, decoder_causal_attention=None, *, enable_dropout=True,
                 decode=False, max_decode_length=None, prefill=None, prefill_lengths=None):
        del decoder_target_tokens, max_decode_length, prefill_lengths  # T5X's signature
        if decode or prefill:
            raise NotImplementedError("nets.Decoder: autoregressive decoding (decode=True, "
                                      "prefill) is not implemented yet; use it for training "
                                      "and scoring")
        c = self.config
        dtype = c.compute_dtype
        tokens_BxL = decoder_input_tokens
        batch, length = tokens_BxL.shape
        segments_BxL = (decoder_segment_ids if decoder_segment_ids is not None
                        else jnp.ones_like(tokens_BxL))
        positions_BxL = (decoder_positions if decoder_positions is not None
                         else jnp.broadcast_to(jnp.arange(length), (batch, length)))
        mask_Bx1xLxS = attention_mask(segments_BxL, decoder_causal_attention)

        embedding_VxD = param_with_axes("token_embedder", nn.initializers.normal(1.0),
                                        (c.vocab_size, c.emb_dim), jnp.float32,
                                        axes=("vocab", "embed"))
        x_BxLxD = jnp.take(embedding_VxD, tokens_BxL, axis=0).astype(dtype)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "embed"))
        x_BxLxD = nn.Dropout(c.dropout_rate)(x_BxLxD, deterministic=not enable_dropout)

        bias_1xHxLxS = None
        if c.position_embedding == "relative":
            # One bias table shared by all layers, as in T5; packing-safe since the
            # buckets come from each token's position within its own segment.
            table_HxN = param_with_axes(
                "relpos_bias", nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                (c.num_heads, c.relative_attention_num_buckets), jnp.float32,
                axes=("heads", "relpos_buckets"))
            relative_BxLxS = positions_BxL[:, None, :] - positions_BxL[:, :, None]
            buckets_BxLxS = relative_position_buckets(
                relative_BxLxS, c.relative_attention_num_buckets, c.relative_attention_max_distance)
            bias_1xHxLxS = jnp.moveaxis(table_HxN[:, buckets_BxLxS], 0, 1)  # [B, H, L, S]

        layer_cls = DecoderLayer
        if _REMAT[c.remat_policy] is not None:
            layer_cls = nn.remat(DecoderLayer, policy=_REMAT[c.remat_policy], prevent_cse=True,
                                 static_argnums=(5,))
        for i in range(c.num_layers):
            x_BxLxD = layer_cls(c, name=f"layers_{i}")(x_BxLxD, mask_Bx1xLxS, bias_1xHxLxS,
                                                       positions_BxL, enable_dropout)
        x_BxLxD = RMSNorm(dtype=dtype, name="decoder_norm")(x_BxLxD)
        x_BxLxD = nn.Dropout(c.dropout_rate)(x_BxLxD, deterministic=not enable_dropout)
        if c.logits_via_embedding:
            logits_BxLxV = jnp.einsum("bld,vd->blv", x_BxLxD, embedding_VxD.astype(dtype))
            logits_BxLxV = logits_BxLxV / jnp.sqrt(c.emb_dim)
        else:
            logits_BxLxV = _dense(self, "logits_dense", x_BxLxD, (c.emb_dim, c.vocab_size),
                                  ("embed", "vocab"), dtype)
        return constrain(logits_BxLxV.astype(jnp.float32), ("batch", "length", "vocab"))
