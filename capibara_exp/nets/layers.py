"""Building blocks of the decoders: projections, norms, embeddings, dropout, rotary positions.

Parameters are float32 and carry T5X's logical axis names (the 'params_axes' collection);
computation runs in the configured dtype. Shape suffixes as in nets/decoder.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

param_with_axes = nn_partitioning.param_with_axes
constrain = nn_partitioning.with_sharding_constraint

ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "linear": lambda x: x}


def dropout(x: jnp.ndarray, rate: float, enable_dropout: bool, name: str | None = None):
    """T5X's dropout: one mask per position shared along axis -2 (length or query)."""
    return nn.Dropout(rate, broadcast_dims=(-2,), name=name)(x, deterministic=not enable_dropout)


class Dense(nn.Module):
    """A bias-free projection whose float32 kernel carries logical axes (T5X's DenseGeneral)."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype
    init_scale: float = 1.0
    distribution: str = "truncated_normal"

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        init = nn.initializers.variance_scaling(self.init_scale, "fan_in", self.distribution)
        kernel = param_with_axes(
            "kernel", init, (x.shape[-1], self.features), jnp.float32, axes=self.axes
        )
        # promote_dtype, Flax's own cast, so a quantized kernel (runtime/lora) stays quantized
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jnp.einsum("...d,df->...f", x, kernel)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias (T5's LayerNorm)."""

    dtype: jnp.dtype
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x_BxLxD: jnp.ndarray) -> jnp.ndarray:
        x = x_BxLxD.astype(jnp.float32)
        scale_D = param_with_axes(
            "scale", nn.initializers.ones, (x.shape[-1],), jnp.float32, axes=("embed",)
        )
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
        return (x * scale_D).astype(self.dtype)


class Embed(nn.Module):
    """Token embedding table; `attend` gives logits against it (tied embeddings)."""

    vocab_size: int
    emb_dim: int

    def setup(self) -> None:
        self.embedding = param_with_axes(
            "embedding",
            nn.initializers.normal(1.0),
            (self.vocab_size, self.emb_dim),
            jnp.float32,
            axes=("vocab", "embed"),
        )

    def __call__(self, tokens_BxL: jnp.ndarray) -> jnp.ndarray:
        return jnp.take(self.embedding, tokens_BxL.astype(jnp.int32), axis=0)

    def attend(self, x_BxLxD: jnp.ndarray) -> jnp.ndarray:
        return jnp.einsum("bld,vd->blv", x_BxLxD.astype(jnp.float32), self.embedding)



def rotate(
    x_BxLxHxK: jnp.ndarray, positions_BxL: jnp.ndarray, max_wavelength: float
) -> jnp.ndarray:
    """Rotary position embedding of queries or keys (first half paired with second half)."""
    half = x_BxLxHxK.shape[-1] // 2
    inv_freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxLx1xK2 = positions_BxL[:, :, None, None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angle_BxLx1xK2), jnp.cos(angle_BxLx1xK2)
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)
