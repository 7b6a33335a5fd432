"""Where tokens are: T5's relative position bias and rotary embeddings (with the frequency
scalings of Llama 3.1 and of linear position interpolation).

Shape suffixes as in nets/decoder.py; K2 is half the head dim (one frequency per pair).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from capibara_exp.nets.layers import param_with_axes


def rope_frequencies(head_dim: int, max_wavelength: float, scaling: str = "none",
                     factor: float = 1.0, low_freq_factor: float = 1.0,
                     high_freq_factor: float = 4.0, original_max_positions: int = 8192
                     ) -> np.ndarray:
    """The inverse wavelengths [K2] of the rotary pairs, float32, computed on the host.

    `linear` divides every frequency by `factor` (positions interpolated). `llama3` (Llama
    3.1) divides only the long wavelengths: those above original_max_positions /
    low_freq_factor are divided by `factor`, those below original_max_positions /
    high_freq_factor are kept, and the band between blends the two linearly in
    original_max_positions / wavelength."""
    inv_freq = 1.0 / max_wavelength ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "llama3":
        wavelength = 2 * math.pi / inv_freq
        ratio = original_max_positions / wavelength
        blend = np.clip((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)
        inv_freq = (1 - blend) * inv_freq / factor + blend * inv_freq
    elif scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not one of none, linear, llama3")
    return inv_freq.astype(np.float32)


def rotate(x_BxLxHxK: jnp.ndarray, positions_BxL: jnp.ndarray,
           inv_freq_K2: np.ndarray) -> jnp.ndarray:
    """Rotary position embedding of queries or keys: dimension i paired with i + K/2."""
    angle_BxLx1xK2 = positions_BxL[:, :, None, None].astype(jnp.float32) * inv_freq_K2
    sin, cos = jnp.sin(angle_BxLx1xK2), jnp.cos(angle_BxLx1xK2)
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def relative_position_buckets(
    relative_BxLxS: jnp.ndarray, num_buckets: int, max_distance: int
) -> jnp.ndarray:
    """T5's causal bucketing of (key - query) positions: exact when near, log-spaced when far.

    Keys after the query (reachable only inside a prefix-LM prefix) share bucket 0 with the
    query itself, as in T5X's decoder, which always buckets unidirectionally.
    """
    distance = jnp.maximum(-relative_BxLxS, 0)
    exact = num_buckets // 2
    log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32)
    far = jnp.minimum(far, num_buckets - 1)
    return jnp.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """Per-head attention bias looked up from bucketed relative positions."""

    num_heads: int
    num_buckets: int
    max_distance: int

    @nn.compact
    def __call__(self, query_positions_BxL: jnp.ndarray,
                 key_positions_BxS: jnp.ndarray | None = None) -> jnp.ndarray:
        table_HxN = param_with_axes(
            "rel_embedding",
            nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
            (self.num_heads, self.num_buckets),
            jnp.float32,
            axes=("heads", "relpos_buckets"),
        )
        keys_BxS = query_positions_BxL if key_positions_BxS is None else key_positions_BxS
        relative_BxLxS = keys_BxS[:, None, :] - query_positions_BxL[:, :, None]
        buckets_BxLxS = relative_position_buckets(
            relative_BxLxS, self.num_buckets, self.max_distance
        )
        return jnp.moveaxis(table_HxN[:, buckets_BxLxS], 0, 1)  # [B, H, L, S]
