"""Merge a LoRA run's adapters into its base model: a normal checkpoint in T5X's layout.

`capibara-exp-lora export run_dir=RUN out=DIR` reads RUN's config.gin (its LoRA model),
the adapters of its latest checkpoint (or `step=N`) and the base that checkpoint's pointer
names, checked against the checksum the pointer recorded. Every quantized kernel is
dequantized to the base's dtype (what the adapted network computed with) and each adapted
kernel W becomes W + alpha / rank * A^T B. DIR/checkpoint_<step> then holds the merged
params with a fresh optimizer state, which the base experiment restores under engine=local
and engine=t5x, to evaluate or train on.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from capibara_exp.base.errors import ConfigError
from capibara_exp.runtime import checkpoints
from capibara_exp.runtime.lora import adapters, base
from capibara_exp.runtime.lora.model import LoraModel
from capibara_exp.runtime.trainer import TrainState

RECORD = "lora_export.json"  # beside the merged checkpoint: what it was merged from


def lora_model(run_dir: Path) -> LoraModel:
    """The LoRA model a run trains: from its config.gin, or from the operative config the
    local engine writes into the model dir (a run given model_dir=... keeps config.gin in
    its Hydra run dir)."""
    import gin
    from capibara_exp.runtime import gin_utils

    found = [run_dir / name for name in ("config.gin", gin_utils.OPERATIVE_CONFIG)
             if (run_dir / name).is_file()]
    if not found:
        raise ConfigError(f"run_dir={run_dir}: neither config.gin nor "
                          f"{gin_utils.OPERATIVE_CONFIG} (not a run's directory)")
    gin_utils.parse(found[0])
    model = gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    if not isinstance(model, LoraModel):
        raise ConfigError(f"run_dir={run_dir}: its config.gin trains {type(model).__name__}, "
                          "not a LoRA model (a run with lora=...)")
    return model


def _step_dir(run_dir: Path, step: int | None) -> Path:
    found = checkpoints.steps(run_dir)
    if not found:
        raise ConfigError(f"run_dir={run_dir}: no checkpoint_<step> in it")
    if step is not None and step not in found:
        raise ConfigError(f"step={step}: {run_dir} has checkpoints at steps {found}")
    return run_dir / f"{checkpoints.STEP_PREFIX}_{found[-1] if step is None else step}"


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the merged checkpoint of a LoRA run to out/checkpoint_<step>; its path."""
    run_dir, out = Path(run_dir).absolute(), Path(out).absolute()
    step_dir = _step_dir(run_dir, step)
    step = int(step_dir.name.rsplit("_", 1)[1])
    target = out / step_dir.name
    if target.exists():
        raise ConfigError(f"out={out}: {target} exists already; give a new out directory")
    model = lora_model(run_dir)
    recorded = base.read_pointer(step_dir)
    base_dir = Path(recorded["base_checkpoint"])
    if not (base_dir / checkpoints.ITEM).is_dir():
        raise ConfigError(f"{step_dir}/{base.POINTER}: its base {base_dir} is gone; the merge "
                          "needs the base the adapters were trained on")
    current = base.pointer(base_dir, model.quantize_base, model.quantize_block_size)
    base.check_same_base(recorded, current, str(step_dir))
    layout = model.layout
    base.check_shapes(base_dir, layout.base_shapes)
    merged = model.merged_params(base.restore_params(step_dir, layout.adapter_shapes),
                                 base.restore_params(base_dir, layout.base_shapes))
    state = TrainState(step=jnp.asarray(step, jnp.int32), params=merged,
                       opt_state=model.optimizer_def.optax_optimizer.init(merged))
    record = {"lora_run": str(run_dir), "lora_checkpoint": str(step_dir), **recorded,
              "merged_kernels": sorted(k.removesuffix(adapters.SUFFIX_A)
                                       for k in layout.adapter_shapes
                                       if k.endswith(adapters.SUFFIX_A))}
    mgr = checkpoints.manager(out)
    checkpoints.save(mgr, step, state.state_dict(), {RECORD: record})
    mgr.close()
    return target
