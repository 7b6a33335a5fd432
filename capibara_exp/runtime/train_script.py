"""`train_script.train`: T5X's train contract, run by the local engine.

A plain function of its arguments (gin binds them at the edge, in gin_utils). It builds
the state, restores the latest checkpoint with the data position, then trains, evaluates,
checkpoints and runs actions on T5X's schedule.
"""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import unfreeze
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec

from capibara_exp.kernels import segment_stats
from capibara_exp.runtime import checkpoints, inputs
from capibara_exp.runtime import curriculum as staged
from capibara_exp.runtime.config import (
    CheckpointConfig,
    DatasetConfig,
    UnsupportedParameter,
    reject_unsupported,
    require_value,
)
from capibara_exp.runtime.metrics import (
    MetricsWriter,
    Progress,
    model_flops_per_token,
    run_peak_flops,
    summarize,
)
from capibara_exp.runtime.trainer import BaseAction, Trainer, TrainState


class TrainingDiverged(RuntimeError):
    """The loss became NaN or Inf (too often, under the skip policy); the last good
    checkpoint is left as it was."""


def _periods_check(total_steps: int, eval_period: int | None, save_period: int | None) -> int:
    """Steps between host-side work (T5X's epoch): the smallest period; each must divide by it."""
    periods = {"train_script.train.eval_period": eval_period,
               "utils.SaveCheckpointConfig.period": save_period}
    for name, period in periods.items():
        if period is not None and period < 0:
            raise ValueError(f"{name} must not be negative, got {period}")
    epoch = min((p for p in periods.values() if p), default=total_steps)
    for name, period in periods.items():
        if period and period % epoch:
            raise ValueError(f"{name}={period} is not a multiple of {epoch}, the shortest of "
                             f"{', '.join(f'{n}={p}' for n, p in periods.items() if p)}")
    return epoch


def _check_actions(actions: Mapping[str, Sequence[BaseAction]] | None,
                   concurrent_metrics: bool) -> dict[str, list[BaseAction]]:
    """T5X's action modes that the local engine runs: TRAIN_EVAL, and TRAIN after each train
    report (T5X runs TRAIN actions only with concurrent_metrics=False and skips them otherwise)."""
    actions = {mode: list(acts) for mode, acts in (actions or {}).items()}
    unknown = set(actions) - {"TRAIN", "TRAIN_EVAL", "INFER_EVAL"}
    if unknown:
        raise ValueError(f"train_script.train.actions: modes {sorted(unknown)} are not T5X's "
                         "action modes (TRAIN, TRAIN_EVAL, INFER_EVAL)")
    if actions.get("INFER_EVAL"):
        raise UnsupportedParameter(
            "train_script.train.actions['INFER_EVAL'] would never run: the local engine has no "
            "inference evaluation; bind the action under TRAIN_EVAL or run with engine=t5x")
    if actions.get("TRAIN") and concurrent_metrics:
        raise UnsupportedParameter(
            "train_script.train.actions['TRAIN'] needs train_script.train.concurrent_metrics = "
            "False (T5X skips TRAIN actions when metrics are computed concurrently)")
    return actions


def _opt_state_axes(opt_shapes: Any, param_axes: Any) -> Any:
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


def _state_and_axes(model: Any, variables: dict, init_opt: Callable[[Any], Any], step: Any
                    ) -> tuple[TrainState, TrainState]:
    params = variables["params"]
    param_axes = unfreeze(nn_partitioning.get_axis_names(variables["params_axes"]))
    opt_state = init_opt(params)
    state = TrainState(step=step, params=params, opt_state=opt_state)
    axes = TrainState(step=PartitionSpec(), params=param_axes,
                      opt_state=_opt_state_axes(opt_state, param_axes))
    return state, axes


def initial_state(model: Any, rng: jax.Array, batch_size: int, length: int
                  ) -> tuple[TrainState, TrainState]:
    """(state, logical axes of the state) for a model and an input shape."""
    variables = model.get_initial_variables(rng, batch_size, length)
    return _state_and_axes(model, variables, jax.jit(model.optimizer_def.optax_optimizer.init),
                           jnp.asarray(0, jnp.int32))


def state_shapes(model: Any, batch_size: int, length: int) -> tuple[TrainState, TrainState]:
    """initial_state's shapes and dtypes without computing it (for ahead-of-time compiles
    of models too large for this host)."""
    variables = jax.eval_shape(
        lambda rng: model.get_initial_variables(rng, batch_size, length), jax.random.PRNGKey(0))
    return _state_and_axes(model, variables,
                           lambda p: jax.eval_shape(model.optimizer_def.optax_optimizer.init, p),
                           jax.ShapeDtypeStruct((), jnp.int32))


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


def lower_train_step(*, model: Any, train_dataset_cfg: DatasetConfig, partitioner: Any,
                     trainer_cls: Callable[..., Trainer], ema_decay: float | None = None,
                     skip_nonfinite_updates: bool = False,
                     max_consecutive_skips: int | None = None, **train_kwargs: Any
                     ) -> jax.stages.Lowered:
    """The train step that `train` would run with these arguments (pass it train's gin
    bindings), lowered for shapes only: nothing is initialised, so a model far larger than
    this host fits. Compile the result for the partitioner's devices (a TPU topology)."""
    del train_kwargs  # the rest of train's arguments do not change the step
    length = max(train_dataset_cfg.task_feature_lengths.values())
    batch_size = train_dataset_cfg.batch_size
    state, axes = state_shapes(model, batch_size, length)
    trainer = make_trainer(trainer_cls, model, partitioner, state, axes, jax.random.PRNGKey(0),
                           batch_size, None, ema_decay=ema_decay,
                           skip_nonfinite_updates=skip_nonfinite_updates,
                           max_consecutive_skips=max_consecutive_skips)
    return trainer.lower_train_step(state, batch_shapes(train_dataset_cfg, model))


def _sum_metrics(window: Sequence[dict]) -> dict[str, float]:
    fetched = jax.device_get(list(window))
    return {k: float(np.sum([m[k] for m in fetched])) for k in fetched[0]}


def train(
    *,
    model: Any,
    train_dataset_cfg: DatasetConfig,
    train_eval_dataset_cfg: DatasetConfig | None,
    infer_eval_dataset_cfg: DatasetConfig | None,
    checkpoint_cfg: CheckpointConfig,
    partitioner: Any,
    trainer_cls: Callable[..., Trainer],
    model_dir: str,
    total_steps: int,
    eval_steps: int,
    eval_period: int,
    stats_period: int | None = None,
    random_seed: int | None,
    use_hardware_rng: bool = False,
    summarize_config_fn: Callable[[str, Any, int], None],
    inference_evaluator_cls: Any = None,
    get_dataset_fn: Any = None,
    concurrent_metrics: bool = True,
    actions: Mapping[str, Sequence[BaseAction]] | None = None,
    train_eval_get_dataset_fn: Any = None,
    run_eval_before_training: bool = False,
    train_state_initializer_cls: Any = None,
    use_orbax: bool = True,
    verify_matching_vocabs_fn: Any = None,
    gc_period: int = 0,
    curriculum: Sequence[Mapping[str, Any]] | None = None,
    ema_decay: float | None = None,
    skip_nonfinite_updates: bool = False,
    max_consecutive_skips: int | None = None,
) -> tuple[int, TrainState]:
    """Train `model` for `total_steps`, resuming from the latest checkpoint in model_dir.

    The last four parameters are the local engine's own (T5X has none of them):
    `curriculum` replaces the train task by stages (runtime/curriculum.py); `ema_decay`,
    `skip_nonfinite_updates` and `max_consecutive_skips` go to the trainer class, which
    must accept them (trainer.Trainer does), so a trainer without them fails loudly.
    """
    reject_unsupported("train_script.train", infer_eval_dataset_cfg=infer_eval_dataset_cfg,
                       use_hardware_rng=use_hardware_rng,
                       inference_evaluator_cls=inference_evaluator_cls,
                       get_dataset_fn=get_dataset_fn,
                       train_eval_get_dataset_fn=train_eval_get_dataset_fn,
                       train_state_initializer_cls=train_state_initializer_cls,
                       verify_matching_vocabs_fn=verify_matching_vocabs_fn)
    require_value("train_script.train", "use_orbax", use_orbax, True, "checkpoints with Orbax")
    require_value("train_script.train", "gc_period", gc_period, 0,
                  "leaves garbage collection to Python")
    # Metrics are computed synchronously whatever concurrent_metrics says; it only decides,
    # as in T5X, whether TRAIN actions may run.
    actions = _check_actions(actions, concurrent_metrics)
    save_cfg, restore_cfg = checkpoint_cfg.save, checkpoint_cfg.restore
    extra_save_steps = set(save_cfg.checkpoint_steps or ()) if save_cfg else set()
    epoch = _periods_check(total_steps, eval_period, save_cfg.period if save_cfg else None)
    stats_period = stats_period or epoch
    stages = staged.parse_stages(curriculum, total_steps) if curriculum else None
    if random_seed is None:
        random_seed = random.SystemRandom().randint(0, 2**31 - 1)
    model_dir = str(Path(model_dir).absolute())
    # Process 0 writes metrics, the operative config and the progress line (as T5X); every
    # process trains, checkpoints (Orbax coordinates them) and decides when to stop alike.
    lead = jax.process_index() == 0
    writer = MetricsWriter(model_dir) if lead else _NoWriter()
    progress = Progress(total_steps) if lead else Progress(total_steps, stream=io.StringIO())

    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(random_seed))
    length = max(train_dataset_cfg.task_feature_lengths.values())
    batch_size = train_dataset_cfg.batch_size
    state, state_axes = initial_state(model, init_rng, batch_size, length)
    trainer = make_trainer(trainer_cls, model, partitioner, state, state_axes, dropout_rng,
                           batch_size, model_dir, ema_decay=ema_decay,
                           skip_nonfinite_updates=skip_nonfinite_updates,
                           max_consecutive_skips=max_consecutive_skips)
    state = trainer.prepare_state(state)

    state, start_step = _restore(state, restore_cfg, model_dir, progress)
    data_seed = train_dataset_cfg.seed if train_dataset_cfg.seed is not None else random_seed
    if stages:
        train_iter = staged.batches(stages, train_dataset_cfg, model.FEATURE_CONVERTER_CLS,
                                    data_seed, start_step)
    else:
        train_iter = inputs.batches(train_dataset_cfg, model.FEATURE_CONVERTER_CLS, data_seed,
                                    skip_batches=start_step)
    data_sharding = partitioner.data_sharding()
    eval_batches = [global_batch(b, data_sharding)
                    for b in _eval_batches(train_eval_dataset_cfg, model, eval_steps)]
    mgr = checkpoints.manager(model_dir, save_cfg.keep) if save_cfg else None

    max_skips = trainer.max_consecutive_skips if trainer.skip_nonfinite_updates else None
    window = _Window(batch_size * length, max_skips)
    net_config = getattr(model.module, "config", None)
    window.flops_per_step = batch_size * length * model_flops_per_token(
        getattr(model, "frozen_params", None) or state.params, net_config, length,
        getattr(model.module, "moe_config", None))
    # One device's measured peak in the compute dtype times the devices the step runs on
    # (simulated CPU devices share the host's cores, so there MFU reads low).
    if lead:  # the MFU baseline is measured once, by the process that reports it
        window.peak_flops = run_peak_flops(model_dir, getattr(net_config, "dtype", "float32")
                                           ) * jax.device_count()
    step, stop = start_step, False
    task = train_eval_dataset_cfg.mixture_or_task_name if train_eval_dataset_cfg else None
    if run_eval_before_training and eval_batches:
        metrics_by_task = _train_eval(trainer, state, eval_batches, task, step, writer, progress)
        stop = run_actions(actions.get("TRAIN_EVAL", []), state, metrics_by_task)
    while step < total_steps and not stop:
        host_batch = window.next_batch(train_iter)
        state, step_metrics = trainer.train_step(state, global_batch(host_batch, data_sharding))
        window.add(step, step_metrics)
        step += 1
        if step == start_step + 1:  # compiled: time steady-state steps from here
            window.check_finite()
            if lead:
                summarize_config_fn(model_dir, writer, step)
            progress.message(f"compiled and ran step {step}; training to step {total_steps}")
            window.reset()
        final = step == total_steps
        end_of_epoch = step % epoch == 0 or final
        if window.steps and (step % stats_period == 0 or end_of_epoch):
            m = window.flush()
            writer.write(step, "train", m)
            progress.update(step, m["loss"], m["tokens_per_s"], m["step_time_s"],
                            m.get("data_wait_share"))
            stop = run_actions(actions.get("TRAIN", []), state, {"train": m}) or stop
        if end_of_epoch:
            metrics_by_task = {}
            if eval_batches and (final or step % (eval_period or total_steps) == 0):
                metrics_by_task = _train_eval(trainer, state, eval_batches, task, step, writer,
                                              progress)
            if mgr and (final or step % (save_cfg.period or total_steps) == 0
                        or step in extra_save_steps):
                _save(mgr, step, state, save_cfg.dtype, model)
            stop = run_actions(actions.get("TRAIN_EVAL", []), state, metrics_by_task) or stop
            window.reset()  # evaluation and checkpointing are not step time
        elif mgr and step in extra_save_steps:  # T5X's checkpoint_steps: extra steps to save
            t0 = time.perf_counter()
            _save(mgr, step, state, save_cfg.dtype, model)
            window.t0 += time.perf_counter() - t0  # checkpointing is not step time
    if stop and mgr and step not in checkpoints.steps(model_dir):
        _save(mgr, step, state, save_cfg.dtype, model)
    if mgr:
        mgr.close()
    if lead:
        summarize_config_fn(model_dir, writer, step)
    writer.close()
    progress.message(f"finished at step {step}; checkpoints in {model_dir}")
    return step, state


def _save(mgr: Any, step: int, state: TrainState, dtype: str, model: Any) -> None:
    # A model may add files to each checkpoint (a LoRA run: the pointer to its base model).
    sidecars = model.checkpoint_sidecars() if hasattr(model, "checkpoint_sidecars") else None
    checkpoints.save(mgr, step, checkpoints.cast_floats(state.state_dict(), dtype), sidecars)


def global_batch(batch: dict[str, np.ndarray], sharding: Any) -> dict[str, jax.Array]:
    """A host batch as global arrays. Every process holds the whole global batch (the input
    is deterministic for a seed) and places the rows its own devices hold, so N processes
    train on exactly the batches one process would."""
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
            for k, v in batch.items()}


def run_actions(actions: Sequence[BaseAction], state: TrainState, metrics: Mapping) -> bool:
    """Actions run on process 0 only (as in T5X); whether one asked to stop reaches every
    process, so all leave the loop at the same step."""
    stop = False
    if jax.process_index() == 0:
        for action in actions:
            stop = action.run(state, metrics) or stop
    if actions and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stop = bool(multihost_utils.broadcast_one_to_all(np.int32(stop)))
    return stop


class _NoWriter:
    """The metrics writer of processes other than 0: they report nothing."""

    def write(self, *args: Any) -> None:
        pass

    def text(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Window:
    """Step metrics since the last report, with the wall time, data wait and real tokens."""

    def __init__(self, tokens_per_step: int, max_consecutive_skips: int | None = None):
        self.tokens_per_step = tokens_per_step
        self.max_consecutive_skips = max_consecutive_skips  # None: stop at the first NaN/Inf
        self.consecutive_skips = 0  # across windows: a run of skips may straddle a report
        self.skipped_total = 0  # skipped steps in this process's training (resumes restart it)
        self.flops_per_step = 0.0  # analytic model FLOPs (metrics.model_flops_per_token)
        self.peak_flops = 0.0  # the machine's measured matmul peak
        self.reset()

    def reset(self) -> None:
        self.metrics: list[dict] = []
        self.first_step = 0
        self.wait_s = 0.0
        self.tokens = 0
        self.t0 = time.perf_counter()

    @property
    def steps(self) -> int:
        return len(self.metrics)

    def next_batch(self, it) -> dict:
        t0 = time.perf_counter()
        batch = next(it)
        self.wait_s += time.perf_counter() - t0
        if "decoder_segment_ids" in batch:
            self.tokens += int(segment_stats.segment_stats(batch["decoder_segment_ids"])[0].sum())
        else:
            self.tokens += int(batch["decoder_loss_weights"].sum())
        return batch

    def add(self, step: int, metrics: dict) -> None:
        if not self.metrics:
            self.first_step = step
        self.metrics.append(metrics)

    def check_finite(self) -> None:
        """Raise TrainingDiverged naming the step where the loss or gradient went NaN/Inf (or,
        under the skip policy, where max_consecutive_skips skipped steps in a row ended)."""
        for offset, m in enumerate(jax.device_get(self.metrics)):
            step = self.first_step + offset + 1
            if self.max_consecutive_skips is None:
                if not (np.isfinite(m["loss_sum"]) and np.isfinite(m["grad_norm"])):
                    raise TrainingDiverged(
                        f"loss or gradient became NaN/Inf at step {step}; training stopped, "
                        "the last checkpoint written before it is intact")
                continue
            self.skipped_total += int(m["skipped_steps"])
            self.consecutive_skips = self.consecutive_skips + 1 if m["skipped_steps"] else 0
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise TrainingDiverged(
                    f"loss or gradient was NaN/Inf for {self.consecutive_skips} steps in a row "
                    f"(trainer.Trainer.max_consecutive_skips={self.max_consecutive_skips}) at "
                    f"step {step}; training stopped, the last checkpoint written is intact")

    def flush(self) -> dict[str, float]:
        """The report for this window (after checking it is finite), then a new window."""
        self.check_finite()
        elapsed = time.perf_counter() - self.t0
        n = self.steps
        sums = _sum_metrics(self.metrics)
        m = summarize(sums)
        updated = n - sums.get("skipped_steps", 0.0)
        m.update(learning_rate=float(jax.device_get(self.metrics[-1]["learning_rate"])),
                 grad_norm=sums["grad_norm"] / max(updated, 1.0), step_time_s=elapsed / n,
                 tokens_per_s=self.tokens / elapsed, data_wait_share=self.wait_s / elapsed,
                 packing_fill=self.tokens / (n * self.tokens_per_step))
        if self.peak_flops:
            m["mfu"] = self.flops_per_step / (elapsed / n) / self.peak_flops
        if "skipped_steps" in sums:
            m.update(skipped_steps=sums["skipped_steps"], skipped_steps_total=self.skipped_total)
        self.reset()
        return m


def _restore(state: TrainState, cfg: Any, model_dir: str, progress: Progress
             ) -> tuple[TrainState, int]:
    """Restore the latest (or a specific) checkpoint; the step is also the data position."""
    if cfg is None:
        return state, 0
    for path in cfg.paths:
        if cfg.mode == "latest" and not Path(path).is_dir():  # as in T5X
            raise ValueError(f"utils.RestoreCheckpointConfig.path: {path} is not a directory "
                             "(mode 'latest' looks for checkpoint_<step> in one)")
        found = checkpoints.steps(path) if cfg.mode == "latest" else []
        if cfg.mode == "specific":
            ckpt = Path(path)
            found = [int(ckpt.name.split("_")[-1])] if ckpt.name.startswith("checkpoint_") else []
            path = str(ckpt.parent)
        if found:
            template = state.state_dict()
            if cfg.dtype:
                template = checkpoints.cast_floats(template, cfg.dtype)
            tree = checkpoints.restore(path, found[-1], template)
            tree = jax.tree.map(lambda r, t: r.astype(t.dtype), tree, state.state_dict())
            progress.message(f"restored {path}/checkpoint_{found[-1]}")
            restored = state.restore_state(tree)
            return restored, int(jax.device_get(restored.step))
    if cfg.mode == "specific":
        raise FileNotFoundError(f"utils.RestoreCheckpointConfig.path: no checkpoint at {cfg.path}")
    return state, 0  # as in T5X: mode 'latest' and no checkpoint yet is a start from scratch


def _train_eval(trainer: Trainer, state: TrainState, eval_batches: list[dict], task: str,
                step: int, writer: MetricsWriter, progress: Progress) -> dict[str, dict]:
    """One train-eval pass, written and shown; T5X's metrics_by_task for the actions."""
    eval_m = summarize(_sum_metrics([trainer.eval_step(state, b) for b in eval_batches]))
    writer.write(step, "train_eval", eval_m)
    progress.message(f"step {step}: eval loss {eval_m['loss']:.4f} "
                     f"accuracy {eval_m['accuracy']:.4f}")
    return {task: eval_m}


def _eval_batches(cfg: DatasetConfig | None, model: Any, eval_steps: int) -> list[dict]:
    """The same eval_steps batches for every evaluation, so curves compare like with like."""
    if cfg is None or eval_steps <= 0:
        return []
    it = inputs.batches(cfg, model.FEATURE_CONVERTER_CLS, cfg.seed, repeat=True)
    return [next(it) for _ in range(eval_steps)]
