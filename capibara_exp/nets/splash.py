"""JAX's Pallas splash-attention kernel on TPU (what MaxText's `attention='flash'` runs).

Blocks of queries and keys in VMEM, fully masked blocks skipped, the scores never written to
HBM. The kernel is TPU-only, so the choice is made when the step is lowered
(`lax.platform_dependent`): lowered for a TPU (a real slice or an ahead-of-time compile for
one), it is the kernel; lowered for CPU or GPU, the same config runs dot attention. Its mask
is causal within a segment (packing), padding (target 0) its own segment, which is dot
attention's mask on every real position; in a sliding-window layer also local.
Grouped-query attention runs the kernel's multi-query form once per key/value head (vmap),
so keys and values are never repeated per query head.

Shape suffixes as in nets/attention.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from capibara_exp.base import logical_axes as axes

# Splash's query/key block: MaxText's default (sa_block_q = sa_block_kv = 512); shorter
# sequences use one block of their own length. DecoderConfig.splash_block sets another
# (MaxText's Llama recipes use 2048), splash_fused_bwd the kernel's fused dq/dkv backward.
SPLASH_BLOCK = 512


def splash_block(length: int, block: int = SPLASH_BLOCK) -> int:
    """The kernel's query and key block for a sequence length; an error if none fits."""
    block = min(block, length)
    if length % block or block % 128:
        raise ValueError(
            f"DecoderConfig.attention='splash': sequence length {length} must be a multiple of "
            f"128, and of the block ({block}, model.splash_block) when longer; use "
            "attention='dot' or pad the sequences (data.task_feature_lengths)")
    return block


def _kernel(num_heads: int, length: int, grouped: bool, cap: float | None,
            window: int | None, interpret: bool, block: int = SPLASH_BLOCK,
            fused_bwd: bool = False):
    """A causal (or local) splash kernel for `num_heads` query heads of `length`. Made inside
    each trace (its mask tables become that trace's constants)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = splash_block(length, block)
    one = (splash.CausalMask((length, length)) if window is None else
           splash.LocalMask((length, length), window_size=(window - 1, 0), offset=0))
    mask = splash.MultiHeadMask([one] * num_heads)
    dq = {} if fused_bwd else {"block_q_dq": block, "block_kv_dq": block}
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, use_fused_bwd_kernel=fused_bwd, **dq)
    make = splash.make_splash_mqa if grouped else splash.make_splash_mha
    return make(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                attn_logits_soft_cap=cap, interpret=interpret)


def splash_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, segments_BxL, *, cap=None, window=None,
                     interpret: bool = False, block: int = SPLASH_BLOCK, fused_bwd: bool = False):
    """The splash kernel, causal within segments, over the current mesh (if any): batch and
    heads split as the logical axis rules in force say (base/logical_axes.py), one kernel per
    device shard (shard_map), each sequence of a shard in turn (vmap)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    def local(q_BxHxLxK, k_BxGxSxK, v_BxGxSxK, seg_BxL):
        h, g = q_BxHxLxK.shape[1], k_BxGxSxK.shape[1]
        kernel = _kernel(h // g if g < h else h, q_BxHxLxK.shape[2], g < h, cap, window,
                         interpret, block, fused_bwd)
        segments = SegmentIds(seg_BxL, seg_BxL)
        if g == h:
            return jax.vmap(kernel)(q_BxHxLxK, k_BxGxSxK, v_BxGxSxK, segments)
        b, _, length, k = q_BxHxLxK.shape
        q_BxGxRxLxK = q_BxHxLxK.reshape(b, g, h // g, length, k)
        per_group = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over the key/value heads
        out = jax.vmap(per_group, in_axes=(0, 0, 0, 0))(q_BxGxRxLxK, k_BxGxSxK, v_BxGxSxK,
                                                         segments)
        return out.reshape(b, h, length, k)

    heads_first = [jnp.swapaxes(x, 1, 2) for x in (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK)]
    if jax.sharding.get_abstract_mesh().empty:
        out_BxHxLxK = local(*heads_first, segments_BxL)
    else:
        spec = nn.logical_to_mesh_axes((axes.BATCH, axes.HEADS, axes.LENGTH, axes.KV))
        kv_spec = nn.logical_to_mesh_axes((axes.BATCH, axes.KV_HEADS, axes.LENGTH, axes.KV))
        seq_spec = jax.sharding.PartitionSpec(spec[0], spec[2])
        if kv_spec[1] != spec[1]:
            # Keys and values not split over the query heads' mesh axis (the rules leave
            # kv_heads replicated): each shard gets the key/value head of each of its query
            # heads, so a shard's query heads always read their own group.
            q, k, v = heads_first
            group = q.shape[1] // k.shape[1]
            heads_first = [q, *(jnp.repeat(x, group, axis=1) for x in (k, v))]
            kv_spec = spec
        out_BxHxLxK = jax.shard_map(local, in_specs=(spec, kv_spec, kv_spec, seq_spec),
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


def attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, segments_BxL, dot, *, scale=None, cap=None,
              window=None, block: int = SPLASH_BLOCK, fused_bwd: bool = False):
    """Splash when lowered for a TPU, `dot(q, k, v)` elsewhere; the kernel does not scale
    scores, so the queries are scaled first."""
    if segments_BxL is None:
        raise ValueError("DecoderConfig.attention='splash' needs the segment ids the "
                         "decoder derives from the target tokens")
    splash_block(q_BxLxHxK.shape[1], block)  # a length the kernel cannot take fails anywhere

    def tpu(q, k, v):
        if scale is not None:
            q = (q * scale).astype(q.dtype)
        return splash_attention(q, k, v, segments_BxL, cap=cap, window=window, block=block,
                                fused_bwd=fused_bwd)

    return jax.lax.platform_dependent(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, tpu=tpu, default=dot)
