"""The state/step API: a model's train state, its trainer and its compiled step, for shapes or
arrays. `train` builds its run from these; the mesh planner (tuning/), consensus merging and
the benches build the same pieces from a run's gin bindings (`gin_utils.run_bindings`), so
an MoE run plans and merges with its own partitioner and trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import unfreeze
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec

from capibara_exp.runtime.trainer import Trainer, TrainState
from capibara_exp.runtime.utils import DatasetConfig

# train's own parameters that go to the trainer class (T5X's trainers have none of them).
TRAINER_FEATURES = ("ema_decay", "skip_nonfinite_updates", "max_consecutive_skips")


def opt_state_axes(opt_shapes: Any, param_axes: Any) -> Any:
    """Logical axes of the optimizer state: a param's axes where its path ends in that param's."""
    by_path = {tuple(map(str, path)): spec for path, spec in
               jax.tree_util.tree_flatten_with_path(
                   param_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}

    def axes_for(path, leaf):
        keys = tuple(map(str, path))
        for start in range(len(keys)):
            spec = by_path.get(keys[start:])
            if spec is not None and len(spec) == len(leaf.shape):
                return spec
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(axes_for, opt_shapes)


def _state_and_axes(variables: dict, init_opt: Callable[[Any], Any], step: Any
                    ) -> tuple[TrainState, TrainState]:
    params = variables["params"]
    param_axes = unfreeze(nn_partitioning.get_axis_names(variables["params_axes"]))
    opt_state = init_opt(params)
    state = TrainState(step=step, params=params, opt_state=opt_state)
    axes = TrainState(step=PartitionSpec(), params=param_axes,
                      opt_state=opt_state_axes(opt_state, param_axes))
    return state, axes


def initial_state(model: Any, rng: jax.Array, batch_size: int, length: int
                  ) -> tuple[TrainState, TrainState]:
    """(state, logical axes of the state) for a model and an input shape."""
    variables = model.get_initial_variables(rng, batch_size, length)
    return _state_and_axes(variables, jax.jit(model.optimizer_def.optax_optimizer.init),
                           jnp.asarray(0, jnp.int32))


def state_shapes(model: Any, batch_size: int, length: int) -> tuple[TrainState, TrainState]:
    """initial_state's shapes and dtypes without computing it (for ahead-of-time compiles
    of models too large for this host)."""
    variables = jax.eval_shape(
        lambda rng: model.get_initial_variables(rng, batch_size, length), jax.random.PRNGKey(0))
    return _state_and_axes(variables,
                           lambda p: jax.eval_shape(model.optimizer_def.optax_optimizer.init, p),
                           jax.ShapeDtypeStruct((), jnp.int32))


def trainer_features(bindings: Mapping[str, Any]) -> dict[str, Any]:
    """The local engine's trainer features (EMA, the skip policy) among train's bindings."""
    return {k: bindings[k] for k in TRAINER_FEATURES if k in bindings}


def make_trainer(trainer_cls: Callable[..., Trainer], model: Any, partitioner: Any,
                 state: TrainState, state_axes: TrainState, rng: jax.Array, batch_size: int,
                 summary_dir: str | None, **features: Any) -> Trainer:
    """The trainer for a state (arrays or shapes); the local engine's own features (EMA, the
    skip policy) go to the trainer class only when set, so T5X's classes stay usable."""
    trainer = trainer_cls(model=model, train_state=state, partitioner=partitioner,
                          eval_names=[], summary_dir=summary_dir, train_state_axes=state_axes,
                          rng=rng, **{k: v for k, v in features.items() if v})
    trainer.check_batch_size(batch_size)
    return trainer


def batch_shapes(dataset_cfg: DatasetConfig, model: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of the batches the input pipeline feeds the train step."""
    names = ["decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights"]
    if dataset_cfg.pack:
        names += ["decoder_segment_ids", "decoder_positions"]
    label = getattr(model, "router_label_feature", None)
    if label:
        names.append(f"decoder_{label}")
    shape = (dataset_cfg.batch_size, max(dataset_cfg.task_feature_lengths.values()))
    return {name: jax.ShapeDtypeStruct(shape, jnp.int32) for name in names}


def placed_shapes(trainer: Trainer, state: TrainState, batch: Mapping[str, Any]
                  ) -> tuple[TrainState, dict[str, jax.ShapeDtypeStruct]]:
    """Shapes of a state and a batch with the shardings the trainer gives them, so a step
    compiled for them is the one a call with the placed arrays runs (no second compile)."""
    if trainer.ema_decay is not None and state.ema_params is None:
        state = state.replace(ema_params=state.params)

    def placed(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    state = jax.tree.map(placed, state, trainer.state_shardings)
    data = trainer.partitioner.data_sharding()
    return state, {k: placed(v, data) for k, v in batch.items()}


def lower_train_step(*, model: Any, train_dataset_cfg: DatasetConfig, partitioner: Any,
                     trainer_cls: Callable[..., Trainer], **train_kwargs: Any
                     ) -> jax.stages.Lowered:
    """The train step that `train` would run with these arguments (pass it train's gin
    bindings), lowered for shapes only: nothing is initialised, so a model far larger than
    this host fits. Compile the result for the partitioner's devices (a TPU topology)."""
    length = max(train_dataset_cfg.task_feature_lengths.values())
    batch_size = train_dataset_cfg.batch_size
    state, axes = state_shapes(model, batch_size, length)
    trainer = make_trainer(trainer_cls, model, partitioner, state, axes, jax.random.PRNGKey(0),
                           batch_size, None, **trainer_features(train_kwargs))
    return trainer.lower_train_step(state, batch_shapes(train_dataset_cfg, model))


def global_batch(batch: dict[str, np.ndarray], sharding: Any) -> dict[str, jax.Array]:
    """A host batch as global arrays. Every process holds the whole global batch (the input
    is deterministic for a seed) and places the rows its own devices hold, so N processes
    train on exactly the batches one process would."""
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
            for k, v in batch.items()}
