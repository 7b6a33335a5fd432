"""T5X's `utils` config surface for the local engine (gin: `from capibara_exp.runtime import
utils`).

Same names, parameters and meanings as t5x/utils.py for what the local runtime does; a
T5X parameter it does not implement is an error naming it, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from capibara_exp.base import model_facts


class UnsupportedParameter(ValueError):
    """A T5X parameter that the local engine does not implement was set."""


def reject_unsupported(owner: str, **params: Any) -> None:
    """Raise for every parameter given a value other than its (T5X) default of None/False."""
    for name, value in params.items():
        if value not in (None, False, (), []):
            raise UnsupportedParameter(
                f"{owner}.{name}={value!r} is a T5X parameter the local engine does not "
                "support; remove the binding or run with engine=t5x")


def require_value(owner: str, name: str, value: Any, supported: Any, behaviour: str) -> None:
    """Raise unless a T5X parameter has the one value whose behaviour the local engine has."""
    if value != supported:
        raise UnsupportedParameter(
            f"{owner}.{name}={value!r} is not supported by the local engine, which always "
            f"{behaviour} (T5X's {name}={supported!r}); remove the binding or run with "
            "engine=t5x")


@dataclasses.dataclass
class DatasetConfig:
    """One data set: a SeqIO task or mixture, split, batch and packing."""

    mixture_or_task_name: str
    task_feature_lengths: Mapping[str, int]
    split: str
    batch_size: int
    shuffle: bool
    seed: int | None
    use_cached: bool = False
    pack: bool = False
    use_custom_packing_ops: bool = False
    module: str | Sequence[str] | None = None
    use_memory_cache: bool = True
    trim_output_features: bool = True
    # The local engine's own (T5X packs with seqio): how the input pipeline packs. The gin
    # edge (gin_utils.parse) hands it the configured data_packing.packer; None: the default.
    packer: Any = None

    def __post_init__(self) -> None:
        reject_unsupported("utils.DatasetConfig", use_cached=self.use_cached,
                           use_custom_packing_ops=self.use_custom_packing_ops)
        require_value("utils.DatasetConfig", "use_memory_cache", self.use_memory_cache, True,
                      "keeps the train-eval batches in memory")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ValueError("utils.DatasetConfig.batch_size must be an integer, got "
                             f"{self.batch_size!r}")
        if self.batch_size <= 0:
            raise ValueError("utils.DatasetConfig.batch_size must be positive, got "
                             f"{self.batch_size}")
        if not self.task_feature_lengths:
            raise ValueError("utils.DatasetConfig.task_feature_lengths is empty")


@dataclasses.dataclass
class SaveCheckpointConfig:
    """When and how to write checkpoints."""

    dtype: str = "float32"
    period: int | None = None
    checkpoint_steps: Sequence[int] | None = None
    keep: int | None = None
    save_dataset: bool = False
    checkpointer_cls: Any = None
    state_transformation_fns: Sequence[Callable] = ()
    checkpoint_manager_cls: Any = None
    keep_dataset_checkpoints: int | None = None

    def __post_init__(self) -> None:
        # save_dataset: T5X saves the train iterator so a resumed run continues the data
        # stream; the local engine's input is deterministic and resumes at the checkpoint's
        # step, so it continues the stream either way and has nothing more to save.
        reject_unsupported("utils.SaveCheckpointConfig",
                           keep_dataset_checkpoints=self.keep_dataset_checkpoints,
                           checkpointer_cls=self.checkpointer_cls,
                           state_transformation_fns=tuple(self.state_transformation_fns),
                           checkpoint_manager_cls=self.checkpoint_manager_cls)
        if self.keep is not None and self.keep < 1:
            raise ValueError("utils.SaveCheckpointConfig.keep must be >= 1 or None, "
                             f"got {self.keep}")
        steps = self.checkpoint_steps
        if steps is not None and (isinstance(steps, (str, Mapping)) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in steps)):
            raise ValueError("utils.SaveCheckpointConfig.checkpoint_steps must be a list of "
                             f"positive step numbers, got {steps!r}")
        _check_dtype("utils.SaveCheckpointConfig.dtype", self.dtype)


@dataclasses.dataclass
class RestoreCheckpointConfig:
    """Where to restore from, besides the run's own model_dir (which comes first, as in T5X).
    The data position is restored with the step (deterministic input).

    mode 'specific' with strict=False (T5X's finetuning restore; what the project's gin
    binds for checkpoint.initial_checkpoint) restores what the checkpoint has, parameters at
    least, and starts the rest fresh (runtime/initial.py), as T5X's fallback_to_scratch
    does; strict=True needs the whole state. A None or empty path restores nothing."""

    path: str | Sequence[str] | None
    mode: str = "latest"
    assignment_map: Any = None
    strict: bool = True
    fallback_to_scratch: bool = False
    dtype: str | None = None
    restore_dataset: bool = False
    checkpointer_cls: Any = None
    state_transformation_fns: Sequence[Callable] = ()
    checkpoint_manager_cls: Any = None

    def __post_init__(self) -> None:
        from capibara_exp.runtime.initial import as_saved  # the identity T5X needs

        if self.mode not in ("latest", "specific"):
            raise ValueError(f"utils.RestoreCheckpointConfig.mode: '{self.mode}' is not supported "
                             "by the local engine (use 'latest' or 'specific')")
        transforms = tuple(f for f in self.state_transformation_fns  # gin may wrap it
                           if inspect.unwrap(f) is not inspect.unwrap(as_saved))
        reject_unsupported("utils.RestoreCheckpointConfig", assignment_map=self.assignment_map,
                           restore_dataset=self.restore_dataset,
                           checkpointer_cls=self.checkpointer_cls,
                           state_transformation_fns=transforms,
                           checkpoint_manager_cls=self.checkpoint_manager_cls)
        if not self.strict and self.mode != "specific":
            raise ValueError("utils.RestoreCheckpointConfig.strict=False: the local engine "
                             "restores part of a state from a specific checkpoint only "
                             "(mode='specific')")
        if self.dtype is not None:
            _check_dtype("utils.RestoreCheckpointConfig.dtype", self.dtype)

    @property
    def paths(self) -> list[str]:
        if not self.path:
            return []
        return [self.path] if isinstance(self.path, str) else list(self.path)


@dataclasses.dataclass
class CheckpointConfig:
    save: SaveCheckpointConfig | None = None
    restore: RestoreCheckpointConfig | None = None


def _check_dtype(where: str, dtype: str) -> None:
    if dtype not in model_facts.DTYPES:
        raise ValueError(f"{where}: '{dtype}' is not one of "
                         f"{', '.join(map(repr, model_facts.DTYPES))}")


_FACTORS = ("constant", "linear_warmup", "rsqrt_decay", "rsqrt_normalized_decay", "decay_every",
            "cosine_decay", "linear_decay")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """T5X's factor-product schedule as a callable step -> learning rate (a jnp scalar).

    Its numbers are `hyperparams`, and `at(step, **hyperparams)` evaluates it with any of
    them replaced by arrays: the local engine's optax keeps them in the optimizer state, so
    a compiled step serves every learning rate (see runtime/hyperparams.py).
    """

    factors: tuple[str, ...]
    hyperparams: Mapping[str, float]

    def __call__(self, step: jnp.ndarray) -> jnp.ndarray:
        return self.at(step)

    def at(self, step: jnp.ndarray, **hyperparams: Any) -> jnp.ndarray:
        hp = {**self.hyperparams, **hyperparams}
        base, warmup = hp["base_learning_rate"], hp["warmup_steps"]
        step = jnp.maximum(0, step - hp["step_offset"]).astype(jnp.float32)
        ret = jnp.float32(1.0)
        for name in self.factors:
            if name == "constant":
                ret *= base
            elif name == "linear_warmup":
                ret *= jnp.minimum(1.0, step / warmup)
            elif name == "rsqrt_decay":
                ret /= jnp.sqrt(jnp.maximum(step, warmup))
            elif name == "rsqrt_normalized_decay":
                ret *= jnp.sqrt(warmup) / jnp.sqrt(jnp.maximum(step, warmup))
            elif name == "decay_every":
                ret *= hp["decay_factor"] ** (step // hp["steps_per_decay"])
            elif name == "cosine_decay":
                progress = jnp.maximum(0.0, (step - warmup) / hp["steps_per_cycle"])
                ret *= jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * (progress % 1.0))))
            elif name == "linear_decay":  # warm-up then linear decay, as T5X writes it
                ret *= base * jnp.minimum(step / warmup,
                                          1.0 + hp["decay_factor"] * (warmup - step))
        return jnp.maximum(ret, hp["min_learning_rate"]).astype(jnp.float32)


def create_learning_rate_scheduler(
    factors: str = "constant * linear_warmup * rsqrt_decay",
    base_learning_rate: float = 0.5,
    warmup_steps: int = 1000,
    decay_factor: float = 0.5,
    steps_per_decay: int = 20000,
    steps_per_cycle: int = 100000,
    step_offset: int = 0,
    min_learning_rate: float = 1e-8,
) -> Schedule:
    """T5X's factor-product schedule: step -> learning rate (a jnp scalar)."""
    names = tuple(n.strip() for n in factors.split("*"))
    for name in names:
        if name not in _FACTORS:
            raise ValueError("utils.create_learning_rate_scheduler.factors: unknown factor "
                             f"'{name}' "
                             f"(known: {', '.join(_FACTORS)})")
    return Schedule(names, {
        "base_learning_rate": float(base_learning_rate), "warmup_steps": float(warmup_steps),
        "decay_factor": float(decay_factor), "steps_per_decay": float(steps_per_decay),
        "steps_per_cycle": float(steps_per_cycle), "step_offset": float(step_offset),
        "min_learning_rate": float(min_learning_rate)})
