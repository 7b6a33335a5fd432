"""LoRA adapters inside the network, added from outside it by a Flax method interceptor.

Each target projection's output gets `(alpha / rank) * dropout(x) @ A @ B`. A and B are
parameters of the projection's own module, named after its kernel (`kernel_lora_a`,
`kernel_lora_b` beside a Dense's `kernel`; `wi_0_lora_a`, ... beside an expert kernel), so
nn.scan stacks them with the layer, remat recomputes them with it, and their logical axes
(the kernel's input axis and 'lora_rank' for A, 'lora_rank' and its output axis for B)
shard them like the kernel. A is [in, rank], per expert [E, in, rank]; B likewise; B starts
at zero, so the first step sees the base model exactly.

The products use lax.dot_general, never einsum: a QLoRA base's quantization rule acts on
the network's einsums only (runtime/lora/quantize.py), so the adapters stay unquantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

from capibara_exp.nets.decoder import Dense
from capibara_exp.nets.moe import ExpertMlp

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
RANK_AXIS = "lora_rank"  # no rule maps it: the rank dimension is replicated
# Batched matmul over a leading expert dimension: [E, ..., I] x [E, I, O] -> [E, ..., O].
_BY_EXPERT = (((3,), (1,)), ((0,), (0,)))


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    targets: frozenset[str]  # projection paths (runtime/lora/targets.py)
    rank: int
    alpha: float
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter(path: str) -> bool:
    return path.endswith((SUFFIX_A, SUFFIX_B))


def _adapter_pair(module: nn.Module, kernel: str, experts: int | None, n_in: int, n_out: int,
                  axes: tuple[str, str], rank: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    lead = () if experts is None else (experts,)
    lead_axes = () if experts is None else ("expert",)
    init_a = nn.initializers.variance_scaling(
        1.0, "fan_in", "normal", in_axis=-2, out_axis=-1, batch_axis=tuple(range(len(lead))))
    a = nn_partitioning.param_with_axes(kernel + SUFFIX_A, init_a, (*lead, n_in, rank),
                                        jnp.float32, axes=(*lead_axes, axes[0], RANK_AXIS),
                                        module=module)
    b = nn_partitioning.param_with_axes(kernel + SUFFIX_B, nn.initializers.zeros,
                                        (*lead, rank, n_out), jnp.float32,
                                        axes=(*lead_axes, RANK_AXIS, axes[1]), module=module)
    return a, b


def _dropped(module: nn.Module, x: jnp.ndarray, rate: float) -> jnp.ndarray:
    """Inverted dropout on the adapter's input; only where the call has a dropout rng (the
    models pass one in training only, so evaluation sees every input)."""
    if not rate or not module.has_rng("dropout"):
        return x
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _dense(cfg: AdapterConfig, module: Dense, y: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
    a, b = _adapter_pair(module, "kernel", None, x.shape[-1], y.shape[-1], module.axes, cfg.rank)
    x = _dropped(module, x, cfg.dropout).astype(y.dtype)
    delta = jnp.matmul(jnp.matmul(x, a.astype(y.dtype)), b.astype(y.dtype))
    return y + (cfg.scale * delta).astype(y.dtype)


def _expert(cfg: AdapterConfig, module: ExpertMlp, y: jnp.ndarray, name: str, x: jnp.ndarray,
            axes: tuple[str, str]) -> jnp.ndarray:
    a, b = _adapter_pair(module, name, x.shape[0], x.shape[-1], y.shape[-1], axes, cfg.rank)
    x = _dropped(module, x, cfg.dropout).astype(y.dtype)
    xa = jax.lax.dot_general(x, a.astype(y.dtype), _BY_EXPERT)
    delta = jax.lax.dot_general(xa, b.astype(y.dtype), _BY_EXPERT)
    return y + (cfg.scale * delta).astype(y.dtype)


def interceptor(cfg: AdapterConfig) -> Callable:
    """A Flax method interceptor (nn.intercept_methods) adding adapters to the targets."""

    def intercept(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        if isinstance(module, Dense) and method == "__call__":
            if "/".join(module.path) in cfg.targets:
                return _dense(cfg, module, next_fun(*args, **kwargs), args[0])
        elif isinstance(module, ExpertMlp) and method == "project":
            name, x, _, axes = args
            if "/".join((*module.path, name)) in cfg.targets:
                return _expert(cfg, module, next_fun(*args, **kwargs), name, x, axes)
        return next_fun(*args, **kwargs)

    return intercept


def delta(a: Any, b: Any, scale: float) -> jnp.ndarray:
    """The kernel's update scale * A @ B (float32), over any leading scan/expert axes."""
    return scale * jnp.matmul(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))


def merge(params: dict[str, Any], adapters: dict[str, Any], scale: float) -> dict[str, Any]:
    """Flat params with each adapted kernel W replaced by W + scale * A @ B in W's dtype (an
    adapter pair is named after its kernel: `<kernel>_lora_a`, `<kernel>_lora_b`)."""
    merged = dict(params)
    for name in adapters:
        if name.endswith(SUFFIX_A):
            kernel = name.removesuffix(SUFFIX_A)
            w = merged[kernel]
            update = delta(adapters[name], adapters[kernel + SUFFIX_B], scale)
            merged[kernel] = (jnp.asarray(w, jnp.float32) + update).astype(w.dtype)
    return merged
