"""`lora.LoraModel`: a model whose trainable parameters are LoRA adapters on a frozen base.

It wraps a model such as `models.DecoderOnlyModel` or `moe_models.MoeDecoderOnlyModel`
(gin: `lora.LoraModel.base = %BASE_MODEL`). Its state is the adapters and their optimizer
state only; the base, read from another run's checkpoint (`base_checkpoint`) and quantized
when `quantize_base` says so (QLoRA), is the trainer's frozen input: an argument of the
compiled step, sharded by the kernels' logical axes, never a constant of the program.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import traverse_util

from capibara_exp.base.errors import ConfigError
from capibara_exp.runtime import checkpoints
from capibara_exp.runtime.lora import adapters, base, quantize, targets
from capibara_exp.runtime.trainer import FrozenInputs

_WHERE = "lora.LoraModel"
_SHAPE_TOKENS = (1, 8)  # parameter shapes do not depend on the input's


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the base model's structure decides: shapes, targets, the network to run."""

    base_shapes: dict[str, jax.ShapeDtypeStruct]  # flat params of the base, unquantized
    base_axes: dict[str, tuple[str, ...]]  # their logical axis names
    stacked: dict[str, int]  # leading scanned 'layers' axes per parameter
    targets: tuple[str, ...]  # projection paths that take adapters
    network: nn.Module  # the base network, quantized where quantize_base says
    templates: dict[str, Any]  # qwix's (abstract) wrappers of the quantized kernels
    adapter_shapes: dict[str, jax.ShapeDtypeStruct]  # flat
    adapter_axes: dict[str, Any]  # the adapters' 'params_axes' collection


def _init_variables(network: nn.Module, cfg: adapters.AdapterConfig, rng: jax.Array,
                    batch_size: int, length: int) -> dict:
    """The network's variables with adapters (models.DecoderOnlyModel's init call)."""
    tokens = jnp.ones((batch_size, length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    with nn.intercept_methods(adapters.interceptor(cfg)):
        return network.init({"params": rng, "dropout": rng}, tokens, tokens, tokens, positions,
                            enable_dropout=False)


def _flat(tree: Any) -> dict[str, Any]:
    return traverse_util.flatten_dict(dict(tree), sep="/")


class LoraModel:
    """A base model whose trainable parameters are low-rank adapters on chosen projections."""

    def __init__(self, base: Any, base_checkpoint: str, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0, target_axes: Sequence[Sequence[str]] = (),
                 target_modules: Sequence[str] = (), quantize_base: str = quantize.NONE,
                 quantize_block_size: int | None = 64, model_dir: str | None = None):
        if rank < 1:
            raise ConfigError(f"{_WHERE}.rank must be >= 1, got {rank}")
        if alpha <= 0:
            raise ConfigError(f"{_WHERE}.alpha must be > 0, got {alpha}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"{_WHERE}.dropout must be in [0, 1), got {dropout}")
        if quantize_base not in quantize.CHOICES:
            raise ConfigError(f"{_WHERE}.quantize_base={quantize_base!r} is not one of "
                              f"{list(quantize.CHOICES)}")
        if quantize_block_size is not None and quantize_block_size < 1:
            raise ConfigError(f"{_WHERE}.quantize_block_size must be >= 1 or None, "
                              f"got {quantize_block_size}")
        self.base, self.base_checkpoint, self.model_dir = base, base_checkpoint, model_dir
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.target_axes = [tuple(t) for t in target_axes]
        self.target_modules = list(target_modules)
        self.quantize_base, self.quantize_block_size = quantize_base, quantize_block_size
        self.scale = alpha / rank
        self.module = base.module
        self.optimizer_def = base.optimizer_def
        self.FEATURE_CONVERTER_CLS = base.FEATURE_CONVERTER_CLS
        self.router_label_feature = getattr(base, "router_label_feature", None)
        self._pointer: dict | None = None

    @functools.cached_property
    def layout(self) -> Layout:
        """The base's structure, targets and quantized network (from shapes only)."""
        rng = jax.random.PRNGKey(0)
        base_vars = jax.eval_shape(lambda: self.base.get_initial_variables(rng, *_SHAPE_TOKENS))
        names = targets.axis_names(base_vars["params_axes"])
        chosen = targets.select(base_vars["params_axes"], self.target_axes, self.target_modules)
        network = self.module
        if self.quantize_base != quantize.NONE:
            kernels = targets.quantizable(base_vars["params_axes"])
            self._check_blocks(kernels, _flat(base_vars["params"]))
            network = quantize.quantized_module(network, {p.module for p in kernels.values()},
                                                 self.quantize_base, self.quantize_block_size)
        cfg = self.adapter_config(chosen)
        full = jax.eval_shape(lambda: _init_variables(network, cfg, rng, *_SHAPE_TOKENS))
        flat = traverse_util.flatten_dict(dict(full["params"]), sep="/",
                                          is_leaf=lambda _, x: quantize.is_wrapped(x))
        projections = targets.projections(base_vars["params_axes"])
        missing = [p for p in chosen if projections[p].param + adapters.SUFFIX_A not in flat]
        if missing:
            raise ConfigError(f"{_WHERE}: projection(s) {missing} take no adapter (only "
                              "nets.Dense kernels and expert kernels do)")
        adapter_axes = {k: v for k, v in _flat(full["params_axes"]).items()
                        if adapters.is_adapter(k.removesuffix("_axes"))}
        return Layout(base_shapes=_flat(base_vars["params"]), base_axes=names,
                      stacked={k: targets.stacked(v) for k, v in names.items()},
                      targets=chosen, network=network,
                      templates={k: v for k, v in flat.items() if quantize.is_wrapped(v)},
                      adapter_shapes={k: v for k, v in flat.items() if adapters.is_adapter(k)},
                      adapter_axes=traverse_util.unflatten_dict(adapter_axes, sep="/"))

    def _check_blocks(self, kernels: dict[str, targets.Projection], shapes: dict) -> None:
        block = self.quantize_block_size
        for proj in kernels.values():
            n_in = shapes[proj.param].shape[-2]
            if block is not None and n_in % block:
                raise ConfigError(f"{_WHERE}.quantize_block_size={block} does not divide the "
                                  f"input size {n_in} of {proj.param}; give a divisor, or None "
                                  "for one scale per output channel")

    def adapter_config(self, chosen: Sequence[str]) -> adapters.AdapterConfig:
        return adapters.AdapterConfig(frozenset(chosen), self.rank, self.alpha, self.dropout)

    @property
    def frozen_params(self) -> dict:
        """The base's parameter shapes (unquantized), for FLOP counts."""
        return traverse_util.unflatten_dict(self.layout.base_shapes, sep="/")

    def get_initial_variables(self, rng: jax.Array, batch_size: int, length: int) -> dict:
        """Adapters ('params': A random, B zero) and their logical axes ('params_axes')."""
        lay = self.layout
        cfg = self.adapter_config(lay.targets)

        def init(rng: jax.Array) -> dict:
            flat = _flat(_init_variables(lay.network, cfg, rng, batch_size, length)["params"])
            return {k: v for k, v in flat.items() if adapters.is_adapter(k)}

        params = jax.jit(init)(rng)  # the base's own init is dead code, dropped by XLA
        return {"params": traverse_util.unflatten_dict(params, sep="/"),
                "params_axes": lay.adapter_axes}

    # ---- the frozen base: the trainer's frozen input ------------------------------------

    def frozen_inputs(self) -> FrozenInputs:
        lay = self.layout
        shapes = jax.eval_shape(lambda p: self._quantized(p), lay.base_shapes)
        return FrozenInputs(shapes=shapes, axes=quantize.frozen_axes(shapes, lay.base_axes),
                            load=self._load)

    def _quantized(self, params: dict[str, Any]) -> dict[str, Any]:
        lay = self.layout
        return quantize.quantize_flat(params, lay.templates, lay.stacked)

    def _load(self, shardings: dict[str, Any]) -> dict[str, Any]:
        """Read the base (checked against its manifest, the model and this run's checkpoints),
        quantize it where asked, and place it on `shardings`."""
        lay = self.layout
        step_dir = base.resolve(self.base_checkpoint)
        record = base.pointer(step_dir, self.quantize_base, self.quantize_block_size)
        self._check_resume(record)
        base.check_shapes(step_dir, lay.base_shapes)
        kernel_shardings = {k: getattr(s, "qvalue", s) for k, s in shardings.items()}
        params = base.restore_params(step_dir, lay.base_shapes, kernel_shardings)
        frozen = jax.jit(self._quantized, out_shardings=shardings)(params) if lay.templates \
            else params
        self._pointer = record
        return frozen

    def _check_resume(self, record: dict) -> None:
        found = checkpoints.steps(self.model_dir) if self.model_dir else []
        if found:
            step_dir = Path(self.model_dir) / f"{checkpoints.STEP_PREFIX}_{found[-1]}"
            recorded = checkpoints.read_sidecar(step_dir, base.POINTER)
            if recorded is not None:
                base.check_same_base(recorded, record, str(step_dir))

    def checkpoint_sidecars(self) -> dict[str, dict]:
        """Files every checkpoint of this run carries: the pointer to the base."""
        if self._pointer is None:
            raise RuntimeError("lora.LoraModel: a checkpoint is saved before the base was read "
                               "(the trainer reads it in prepare_state)")
        return {base.POINTER: self._pointer}

    # ---- computing with it --------------------------------------------------------------

    @functools.cached_property
    def _inner(self) -> Any:
        """The base model running the (quantized) network: its loss, metrics and features."""
        inner = copy.copy(self.base)
        inner.module = self.layout.network
        return inner

    def loss_fn(self, params: Any, batch: dict, dropout_rng: jax.Array | None,
                frozen: dict[str, Any] | None = None) -> tuple[jnp.ndarray, dict]:
        """The base model's loss with adapters `params` on the frozen base `frozen`."""
        if frozen is None:
            raise ValueError(f"{_WHERE}.loss_fn needs the frozen base (frozen=...): the trainer "
                             "passes its frozen inputs (trainer.Trainer.frozen_values())")
        lay = self.layout
        variables = {**quantize.wrap(frozen, lay.templates), **_flat(params)}
        with nn.intercept_methods(adapters.interceptor(self.adapter_config(lay.targets))):
            return self._inner.loss_fn(traverse_util.unflatten_dict(variables, sep="/"), batch,
                                       dropout_rng)

    def merged_params(self, adapter_params: Any, base_params: dict[str, Any]) -> dict:
        """The base params (flat, as read) with the adapters merged in: quantized kernels
        dequantized to the base's dtype, then W + alpha / rank * A^T B on the targets."""
        lay = self.layout
        frozen = jax.jit(self._quantized)(base_params)
        dtypes = {k: v.dtype for k, v in lay.base_shapes.items()}
        plain = jax.jit(functools.partial(quantize.dequantize_flat, dtypes=dtypes))(frozen)
        merged = adapters.merge(plain, _flat(adapter_params), self.scale)
        return traverse_util.unflatten_dict(merged, sep="/")
