"""LoRA adapters inside the network, added from outside it by a Flax method interceptor.

Each target projection's output gets `(alpha / rank) * dropout(x) A^T B`. A and B are
parameters of the projection's own module, named after its kernel (`kernel_lora_a`,
`kernel_lora_b` beside a Dense's `kernel`; `wi_0_lora_a`, ... beside an expert kernel), so
nn.scan stacks them with the layer, remat recomputes them with it, and their logical axes
('lora_rank' and the kernel's input axis for A, 'lora_rank' and its output axis for B)
shard them like the kernel. A is [rank, in] (PEFT's layout of lora_A) and B is [rank, out],
per expert [E, rank, in] and [E, rank, out]; the kernel's update is A^T B. B starts at
zero, so the first step sees the base model exactly. A is kept rank-major because then
every product of the backward pass contracts the token dimension with the small operand
first: XLA's CPU dot for [in, tokens] x [tokens, rank] was 7x slower than for the same
product rank-major (bench/lora.py, docs/lora.md).

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
# Products batched over a leading expert dimension: x [E, G, C, I] with A [E, r, I], then
# x A^T [E, G, C, r] with B [E, r, O].
_X_A = (((3,), (2,)), ((0,), (0,)))
_XA_B = (((3,), (1,)), ((0,), (0,)))


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
    init_a = nn.initializers.variance_scaling(  # A's entries: variance 1 / in
        1.0, "fan_in", "normal", in_axis=-1, out_axis=-2, batch_axis=tuple(range(len(lead))))
    a = nn_partitioning.param_with_axes(kernel + SUFFIX_A, init_a, (*lead, rank, n_in),
                                        jnp.float32, axes=(*lead_axes, RANK_AXIS, axes[0]),
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
    xa = jax.lax.dot_general(x, a.astype(y.dtype), (((x.ndim - 1,), (1,)), ((), ())))
    delta = jnp.matmul(xa, b.astype(y.dtype))
    return y + (cfg.scale * delta).astype(y.dtype)


def _expert(cfg: AdapterConfig, module: ExpertMlp, y: jnp.ndarray, name: str, x: jnp.ndarray,
            axes: tuple[str, str]) -> jnp.ndarray:
    a, b = _adapter_pair(module, name, x.shape[0], x.shape[-1], y.shape[-1], axes, cfg.rank)
    x = _dropped(module, x, cfg.dropout).astype(y.dtype)
    xa = jax.lax.dot_general(x, a.astype(y.dtype), _X_A)
    delta = jax.lax.dot_general(xa, b.astype(y.dtype), _XA_B)
    return y + (cfg.scale * delta).astype(y.dtype)


def _expert_ragged(cfg: AdapterConfig, module: ExpertMlp, y: jnp.ndarray, name: str,
                   x: jnp.ndarray, sizes: jnp.ndarray, axes: tuple[str, str]) -> jnp.ndarray:
    """The adapters of a dropless expert projection: rows grouped by expert, each group
    through its expert's A and B (lax.ragged_dot, as the kernel itself)."""
    a, b = _adapter_pair(module, name, sizes.shape[0], x.shape[-1], y.shape[-1], axes, cfg.rank)
    x = _dropped(module, x, cfg.dropout).astype(y.dtype)
    xa = jax.lax.ragged_dot(x, jnp.swapaxes(a, -1, -2).astype(y.dtype), sizes)
    delta = jax.lax.ragged_dot(xa, b.astype(y.dtype), sizes)
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
        elif isinstance(module, ExpertMlp) and method == "project_ragged":
            name, x, sizes, _, axes = args
            if "/".join((*module.path, name)) in cfg.targets:
                return _expert_ragged(cfg, module, next_fun(*args, **kwargs), name, x, sizes,
                                      axes)
        return next_fun(*args, **kwargs)

    return intercept


def delta(a: Any, b: Any, scale: float) -> jnp.ndarray:
    """The kernel's update scale * A^T B (float32), over any leading scan/expert axes."""
    a_t = jnp.swapaxes(jnp.asarray(a, jnp.float32), -1, -2)
    return scale * jnp.matmul(a_t, jnp.asarray(b, jnp.float32))


def merge(params: dict[str, Any], adapters: dict[str, Any], scale: float) -> dict[str, Any]:
    """Flat params with each adapted kernel W replaced by W + scale * A^T B in W's dtype (an
    adapter pair is named after its kernel: `<kernel>_lora_a`, `<kernel>_lora_b`)."""
    merged = dict(params)
    for name in adapters:
        if name.endswith(SUFFIX_A):
            kernel = name.removesuffix(SUFFIX_A)
            w = merged[kernel]
            update = delta(adapters[name], adapters[kernel + SUFFIX_B], scale)
            merged[kernel] = (jnp.asarray(w, jnp.float32) + update).astype(w.dtype)
    return merged
