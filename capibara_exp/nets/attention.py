"""Causal self-attention: dot-product attention, and JAX's Pallas splash-attention kernel on TPU.

`DecoderConfig.attention` picks the implementation:

- `dot`: einsums and a softmax over the full [B, H, L, S] scores, on every platform. It is
  the reference: relative position bias, prefix-LM masks and attention dropout all work.
- `splash`: `jax.experimental.pallas.ops.tpu.splash_attention` (what MaxText's
  `attention='flash'` runs on TPU today): blocks of queries and keys in VMEM, fully masked
  blocks skipped, the scores never written to HBM. The kernel is TPU-only, so the choice is
  made when the step is lowered (`lax.platform_dependent`): lowered for a TPU (a real slice
  or an ahead-of-time compile for one), it is the kernel; lowered for CPU or GPU, the same
  config runs `dot`. The mask it applies is causal within a segment (packing), padding
  (target 0) its own segment, which is `dot`'s mask on every real position.

Shape suffixes as in nets/decoder.py: B batch, L query length, S key length, D embed,
H heads, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from capibara_exp.nets.layers import Dense, constrain, dropout, rotate

ATTENTIONS = ("dot", "splash")
# Splash's query/key block: MaxText's default (sa_block_q = sa_block_kv = 512); shorter
# sequences use one block of their own length.
SPLASH_BLOCK = 512


def dot_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, mask_Bx1xLxS, bias_BxHxLxS=None,
                  probs_dropout=lambda p: p):
    """Softmax(q k^T + bias) v with float32 scores; masked scores get float32's minimum."""
    dtype = q_BxLxHxK.dtype
    scores_BxHxLxS = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK,
                                preferred_element_type=jnp.float32)
    if bias_BxHxLxS is not None:
        scores_BxHxLxS = scores_BxHxLxS + bias_BxHxLxS
    scores_BxHxLxS = jnp.where(mask_Bx1xLxS, scores_BxHxLxS, jnp.finfo(jnp.float32).min)
    probs_BxHxLxS = probs_dropout(jax.nn.softmax(scores_BxHxLxS, axis=-1).astype(dtype))
    return jnp.einsum("bhls,bshk->blhk", probs_BxHxLxS, v_BxSxHxK)


def splash_block(length: int) -> int:
    """The kernel's query and key block for a sequence length; an error if none fits."""
    block = min(SPLASH_BLOCK, length)
    if length % block or block % 128:
        raise ValueError(
            f"DecoderConfig.attention='splash': sequence length {length} must be a multiple of "
            f"128, and of {SPLASH_BLOCK} when longer (the kernel's blocks); use attention='dot' "
            "or pad the sequences (data.task_feature_lengths)")
    return block


def _kernel(num_heads: int, length: int, interpret: bool):
    """A causal splash kernel for `num_heads` heads of `length`. Made inside each trace (its
    mask tables become that trace's constants); JAX caches the mask processing itself."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = splash_block(length)
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * num_heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                  interpret=interpret)


def splash_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, segments_BxL, interpret: bool = False):
    """The splash kernel, causal within segments, over the current mesh (if any): batch and
    heads split as the logical axis rules in force say ('batch', 'heads'), one kernel per
    device shard (shard_map), each sequence of a shard in turn (vmap)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    def local(q_BxHxLxK, k_BxHxSxK, v_BxHxSxK, seg_BxL):
        kernel = _kernel(q_BxHxLxK.shape[1], q_BxHxLxK.shape[2], interpret)
        return jax.vmap(kernel)(q_BxHxLxK, k_BxHxSxK, v_BxHxSxK, SegmentIds(seg_BxL, seg_BxL))

    heads_first = [jnp.swapaxes(x, 1, 2) for x in (q_BxLxHxK, k_BxSxHxK, v_BxSxHxK)]
    if jax.sharding.get_abstract_mesh().empty:
        out_BxHxLxK = local(*heads_first, segments_BxL)
    else:
        spec = nn.logical_to_mesh_axes(("batch", "heads", "length", "kv"))
        seq_spec = jax.sharding.PartitionSpec(spec[0], spec[2])
        out_BxHxLxK = jax.shard_map(local, in_specs=(spec, spec, spec, seq_spec),
                                    out_specs=spec, check_vma=False)(*heads_first, segments_BxL)
    return jnp.swapaxes(out_BxHxLxK, 1, 2)


def segments_for_splash(target_tokens_BxL, segments_BxL=None):
    """Segment ids the kernel masks by: the packing's segments, padding (target 0) its own
    segment 0, so real tokens see exactly what dot attention's mask lets them see."""
    segments = jnp.ones_like(target_tokens_BxL, jnp.int32) if segments_BxL is None else segments_BxL
    return jnp.where(target_tokens_BxL > 0, segments.astype(jnp.int32), 0)


def splash_segments(attention: str, target_tokens_BxL, segments_BxL=None,
                    causal_attention_BxL=None):
    """What the splash kernel masks by, for a decoder whose attention is `attention` (None
    for dot); a prefix-LM mask is an error (the kernel's mask is causal within segments)."""
    if attention != "splash":
        return None
    if causal_attention_BxL is not None:
        raise ValueError("nets.Decoder: decoder_causal_attention (a prefix-LM mask) needs "
                         "DecoderConfig.attention='dot'; the splash kernel's mask is causal "
                         "within segments")
    return segments_for_splash(target_tokens_BxL, segments_BxL)


class Attention(nn.Module):
    """Multi-head causal self-attention with T5X's projection names and logical axes."""

    config: object  # nets.DecoderConfig (not imported: decoder.py imports this module)

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout,
                 segments_BxL=None):
        c = self.config
        dtype, hk = c.compute_dtype, c.num_heads * c.head_dim

        def project(name: str, init_scale: float = 1.0) -> jnp.ndarray:
            kernel = Dense(hk, ("embed", "joined_kv"), dtype, init_scale, "normal", name=name)
            y_BxLxHK = kernel(x_BxLxD)
            y_BxLxHxK = y_BxLxHK.reshape(y_BxLxHK.shape[:2] + (c.num_heads, c.head_dim))
            return constrain(y_BxLxHxK, ("batch", "length", "heads", "kv"))

        # T5 scales logits by 1/sqrt(head_dim) through the query's initialisation instead.
        q_BxLxHxK = project("query", init_scale=1.0 / c.head_dim)
        k_BxSxHxK = project("key")
        v_BxSxHxK = project("value")
        if c.position_embedding == "rope":
            q_BxLxHxK = rotate(q_BxLxHxK, positions_BxL, c.rope_max_wavelength)
            k_BxSxHxK = rotate(k_BxSxHxK, positions_BxL, c.rope_max_wavelength)

        def dot(q, k, v):
            return dot_attention(q, k, v, mask_Bx1xLxS, bias_BxHxLxS,
                                 lambda p: dropout(p, c.dropout_rate, enable_dropout))

        if c.attention == "splash":
            if segments_BxL is None:
                raise ValueError("DecoderConfig.attention='splash' needs the segment ids the "
                                 "decoder derives from the target tokens")
            splash_block(q_BxLxHxK.shape[1])  # a length the kernel cannot take fails everywhere
            out_BxLxHxK = jax.lax.platform_dependent(
                q_BxLxHxK, k_BxSxHxK, v_BxSxHxK,
                tpu=lambda q, k, v: splash_attention(q, k, v, segments_BxL), default=dot)
        else:
            out_BxLxHxK = dot(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK)
        out_BxLxHK = out_BxLxHxK.reshape(out_BxLxHxK.shape[:2] + (hk,))
        return Dense(c.emb_dim, ("joined_kv", "embed"), dtype, distribution="normal", name="out")(
            out_BxLxHK
        )
