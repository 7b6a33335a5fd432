"""Building blocks of the decoders: projections, norms, embeddings, dropout, soft-capping.

Parameters are float32 and carry T5X's logical axis names (the 'params_axes' collection);
computation runs in the configured dtype. Shape suffixes as in nets/decoder.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

from capibara_exp.base import model_facts

param_with_axes = nn_partitioning.param_with_axes
constrain = nn_partitioning.with_sharding_constraint

ACTIVATIONS = {"gelu": nn.gelu,  # the tanh approximation (Gemma's gelu_pytorch_tanh)
               "gelu_exact": functools.partial(nn.gelu, approximate=False),
               "relu": nn.relu, "silu": nn.silu, "linear": lambda x: x}
assert tuple(ACTIVATIONS) == model_facts.ACTIVATIONS  # one list: model_facts owns the names


def dropout(x: jnp.ndarray, rate: float, enable_dropout: bool, name: str | None = None):
    """T5X's dropout: one mask per position shared along axis -2 (length or query)."""
    return nn.Dropout(rate, broadcast_dims=(-2,), name=name)(x, deterministic=not enable_dropout)


def softcap(x: jnp.ndarray, cap: float | None) -> jnp.ndarray:
    """cap * tanh(x / cap): Gemma 2's soft limit on attention scores and logits."""
    return x if not cap else cap * jnp.tanh(x / cap)


class Dense(nn.Module):
    """A projection whose float32 kernel carries logical axes (T5X's DenseGeneral); with
    `use_bias`, a float32 bias on the output axis (Qwen2's query, key and value)."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype
    init_scale: float = 1.0
    distribution: str = "truncated_normal"
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        init = nn.initializers.variance_scaling(self.init_scale, "fan_in", self.distribution)
        kernel = param_with_axes(
            "kernel", init, (x.shape[-1], self.features), jnp.float32, axes=self.axes
        )
        # promote_dtype, Flax's own cast, so a quantized kernel (runtime/lora) stays quantized
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        y = jnp.einsum("...d,df->...f", x, kernel)
        if self.use_bias:
            bias = param_with_axes("bias", nn.initializers.zeros, (self.features,),
                                   jnp.float32, axes=self.axes[1:])
            y = y + bias.astype(y.dtype)
        return y


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias (T5's LayerNorm), computed in
    float32. `plus_one`: the scale is stored as an offset from 1 (Gemma's norms)."""

    dtype: jnp.dtype
    epsilon: float = 1e-6
    plus_one: bool = False
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = x.astype(jnp.float32)
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = param_with_axes("scale", init, (x.shape[-1],), jnp.float32,
                                axes=(self.axis_name,))
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
        return (x * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


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
