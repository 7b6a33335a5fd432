"""LoRA fine-tuning: low-rank adapters on a frozen base model (the local engine's own feature).

`lora.LoraModel` wraps a model such as `models.DecoderOnlyModel`. Its trainable params are
only the adapters, {module path: {'lora_a': [in, rank], 'lora_b': [rank, out]}}, for the
2-D Dense kernels whose module path (e.g. `layers_0/self_attention/query`) fully matches
one of `target_modules`; the base params are read once from `base_checkpoint` and never
change. A Flax method interceptor adds `alpha / rank * dropout(x) @ A @ B` to each target
Dense's output, so the network code is untouched. `lora_b` starts at zero (the first step
sees the base model exactly). `export_merged` writes W + alpha / rank * A @ B as a normal
checkpoint in T5X's layout:

    python -m capibara_exp.runtime.lora RUN_DIR OUT_DIR
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import traverse_util
from flax.linen import partitioning as nn_partitioning

from capibara_exp.runtime import checkpoints

_WHERE = "lora.LoraModel"


def _module_kernels(params: Any) -> dict[str, Any]:
    """Module path -> kernel, for the 2-D `kernel` leaves of a param tree."""
    flat = traverse_util.flatten_dict(params, sep="/")
    return {k.rsplit("/", 1)[0]: v for k, v in flat.items()
            if k.endswith("/kernel") and len(v.shape) == 2}


def _latest_target(path: str) -> Any:
    """The params ('target') of a checkpoint_<step> dir, or of a model dir's latest one."""
    import orbax.checkpoint as ocp

    root = Path(path)
    if not root.name.startswith(checkpoints.STEP_PREFIX + "_"):
        found = checkpoints.steps(root)
        if not found:
            raise FileNotFoundError(f"{_WHERE}.base_checkpoint: no checkpoint in {root}")
        root = root / f"{checkpoints.STEP_PREFIX}_{found[-1]}"
    state = root / checkpoints.ITEM
    if not state.is_dir():
        raise FileNotFoundError(f"{_WHERE}.base_checkpoint: {state} does not exist")
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(state.absolute())["target"]


def merge(base_params: Any, adapters: Any, scale: float) -> Any:
    """Base params with each adapted kernel replaced by W + scale * A @ B (float32)."""
    flat = traverse_util.flatten_dict(base_params, sep="/")
    for path, ab in traverse_util.flatten_dict(adapters, sep="/", is_leaf=_is_adapter).items():
        kernel = flat[f"{path}/kernel"]
        a, b = (jnp.asarray(ab[k], jnp.float32) for k in ("lora_a", "lora_b"))
        delta = scale * a @ b
        flat[f"{path}/kernel"] = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
    return traverse_util.unflatten_dict(flat, sep="/")


def _is_adapter(_: Any, node: Any) -> bool:
    return isinstance(node, dict) and "lora_a" in node


class LoraModel:
    """A base model whose trainable parameters are low-rank adapters on matching kernels."""

    def __init__(self, base: Any, base_checkpoint: str, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0, target_modules: Sequence[str] = (".*query", ".*value")):
        if rank < 1:
            raise ValueError(f"{_WHERE}.rank must be >= 1, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{_WHERE}.dropout must be in [0, 1), got {dropout}")
        if isinstance(target_modules, str) or not target_modules:
            raise ValueError(f"{_WHERE}.target_modules must be a list of regular expressions, "
                             f"got {target_modules!r}")
        self.base = base
        self.base_checkpoint = base_checkpoint
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.target_modules = [re.compile(p) for p in target_modules]
        self.scale = alpha / rank
        self.module = base.module
        self.optimizer_def = base.optimizer_def
        self.FEATURE_CONVERTER_CLS = base.FEATURE_CONVERTER_CLS
        self._frozen: Any = None

    @property
    def frozen_params(self) -> Any:
        """The base model's params, read from base_checkpoint on first use."""
        if self._frozen is None:
            self._frozen = jax.tree.map(jnp.asarray, _latest_target(self.base_checkpoint))
        return self._frozen

    def targets(self, params: Any) -> dict[str, Any]:
        """Module path -> kernel of the kernels the patterns select (an error if none)."""
        kernels = _module_kernels(params)
        chosen = {p: k for p, k in kernels.items()
                  if any(r.fullmatch(p) for r in self.target_modules)}
        if not chosen:
            raise ValueError(f"{_WHERE}.target_modules={[r.pattern for r in self.target_modules]} "
                             f"match no 2-D kernel; module paths are: {sorted(kernels)}")
        return chosen

    def get_initial_variables(self, rng: jax.Array, batch_size: int, length: int) -> dict:
        """Adapters ('params') and their logical axes ('params_axes') for the base's targets."""
        base_vars = jax.eval_shape(lambda: self.base.get_initial_variables(rng, batch_size, length))
        axes = traverse_util.flatten_dict(base_vars["params_axes"], sep="/")
        params, params_axes = {}, {}
        for i, (path, kernel) in enumerate(sorted(self.targets(self.frozen_params).items())):
            n_in, n_out = kernel.shape
            a = jax.random.normal(jax.random.fold_in(rng, i), (n_in, self.rank)) / jnp.sqrt(n_in)
            params[path] = {"lora_a": a, "lora_b": jnp.zeros((self.rank, n_out), jnp.float32)}
            in_axis, out_axis = axes[f"{path}/kernel_axes"].names
            params_axes[path] = {
                "lora_a_axes": nn_partitioning.AxisMetadata(names=(in_axis, "lora_rank")),
                "lora_b_axes": nn_partitioning.AxisMetadata(names=("lora_rank", out_axis))}
        return {"params": traverse_util.unflatten_dict(params, sep="/"),
                "params_axes": traverse_util.unflatten_dict(params_axes, sep="/")}

    def _interceptor(self, adapters: Any, dropout_rng: jax.Array | None):
        by_path = traverse_util.flatten_dict(adapters, sep="/", is_leaf=_is_adapter)
        index = {p: i for i, p in enumerate(sorted(by_path))}

        def intercept(next_fun, args, kwargs, context):
            y = next_fun(*args, **kwargs)
            path = "/".join(context.module.path)
            if context.method_name != "__call__" or path not in by_path:
                return y
            x = args[0]
            if self.dropout and dropout_rng is not None:
                keep = jax.random.bernoulli(jax.random.fold_in(dropout_rng, index[path]),
                                            1.0 - self.dropout, x.shape)
                x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
            a, b = (by_path[path][k].astype(y.dtype) for k in ("lora_a", "lora_b"))
            return y + (self.scale * (x.astype(y.dtype) @ a) @ b).astype(y.dtype)

        return intercept

    def loss_fn(self, params: Any, batch: dict, dropout_rng: jax.Array | None):
        """The base model's loss with the adapters `params` added to its target kernels."""
        with nn.intercept_methods(self._interceptor(params, dropout_rng)):
            return self.base.loss_fn(self.frozen_params, batch, dropout_rng)

    def merged_params(self, adapters: Any) -> Any:
        return merge(self.frozen_params, adapters, self.scale)

    def export_merged(self, adapters: Any, out_dir: str | Path, step: int) -> Path:
        """A normal checkpoint (T5X layout, fresh optimizer state) of the merged params."""
        from capibara_exp.runtime.trainer import TrainState

        params = self.merged_params(adapters)
        state = TrainState(step=jnp.asarray(step, jnp.int32), params=params,
                           opt_state=self.optimizer_def.optax_optimizer.init(params))
        mgr = checkpoints.manager(out_dir)
        checkpoints.save(mgr, step, state.state_dict())
        mgr.close()
        return Path(out_dir) / f"{checkpoints.STEP_PREFIX}_{step}"


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Merge the latest adapters of a LoRA run (its config.gin names the base) into its base."""
    import gin
    from capibara_exp.runtime import gin_utils

    gin_utils.parse(Path(run_dir) / "config.gin")
    model = gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    if not isinstance(model, LoraModel):
        raise ValueError(f"{run_dir}/config.gin: train_script.train.model is not a lora.LoraModel")
    found = checkpoints.steps(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {run_dir}")
    adapters = _latest_target(str(run_dir))
    return model.export_merged(adapters, out_dir, found[-1])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m capibara_exp.runtime.lora RUN_DIR OUT_DIR")
    print(export_run(sys.argv[1], sys.argv[2]))
