"""`train_script.train`: T5X's train contract, run by the local engine.

A plain function of its arguments (gin binds them at the edge, in gin_utils), in four phases:
setup (checks, sizes against memory, the compiled step, the state), restore (the newest
verified checkpoint, with the data position), the loop (train, evaluate, checkpoint, actions
on T5X's schedule; a clean stop on SIGTERM/SIGINT), finish. State/step API: runtime/state.py.
"""

from __future__ import annotations

import dataclasses
import io
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from capibara_exp.base import phases
from capibara_exp.base.errors import Preempted, TrainingDiverged  # noqa: F401 (callers catch them)
from capibara_exp.runtime import checkpoints, infer_eval, inputs, lineage, monitor, resume
from capibara_exp.runtime import curriculum as staged
from capibara_exp.runtime.actions import check_actions, run_actions
from capibara_exp.runtime.events import Events, EventWriter
from capibara_exp.runtime.metrics import (
    MetricsWriter,
    NullWriter,
    Progress,
    model_flops_per_token,
    run_peak_flops,
    summarize,
)
from capibara_exp.runtime.preemption import Preemption
from capibara_exp.runtime.stages import StagePlan
from capibara_exp.runtime.state import (
    batch_shapes,
    global_batch,
    initial_state,
    make_trainer,
    placed_shapes,
    state_shapes,
    trainer_features,
)
from capibara_exp.runtime.trainer import BaseAction, Trainer, TrainState
from capibara_exp.runtime.utils import (
    CheckpointConfig,
    DatasetConfig,
    reject_unsupported,
    require_value,
)
from capibara_exp.runtime.window import NanGuard, StepWindow, sum_metrics


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


def _check_counts(**counts: Any) -> None:
    """Step counts are integers (`1e9` on a command line is a float)."""
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"train_script.train.{name} must be an integer, got {value!r}")


@dataclasses.dataclass
class _Run:
    """What the phases share."""

    args: dict[str, Any]  # train's arguments
    trainer: Trainer
    model_dir: str
    epoch: int
    stats_period: int
    actions: dict[str, list[BaseAction]]
    writer: Any
    progress: Progress
    window: StepWindow
    guard: NanGuard
    watch: monitor.MemoryWatch
    saver: checkpoints.Checkpointer | None = None
    eval_batches: list[dict] = dataclasses.field(default_factory=list)
    saved: set[int] = dataclasses.field(default_factory=set)
    lineage: list[dict] | None = None  # what the weights descend from (runtime/lineage.py)
    events: Events | None = None  # callback events beyond T5X's actions (runtime/events.py)
    stages: StagePlan | None = None  # a curriculum's per-stage settings (runtime/stages.py)
    infer: Any = None  # the inference evaluator (runtime/infer_eval.py)

    @property
    def save_cfg(self) -> Any:
        return self.args["checkpoint_cfg"].save

    def close(self) -> None:
        self.saver and self.saver.close()  # an in-flight save commits: a good checkpoint
        self.writer.close()
        self.infer and self.infer.close()


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
    memory_warn_fraction: float = 0.85,
) -> tuple[int, TrainState]:
    """Train `model` for `total_steps`, resuming from the newest verified checkpoint.

    The last five parameters are the local engine's own (T5X has none of them):
    `curriculum` replaces the train task by stages (runtime/curriculum.py); `ema_decay`,
    `skip_nonfinite_updates` and `max_consecutive_skips` go to the trainer class, which
    must accept them (trainer.Trainer does); `memory_warn_fraction` (0, 1] of a device's or
    the host's memory above which a warning line is printed (runtime/monitor.py).
    """
    args = dict(locals())
    _check_arguments(args)
    with phases.phase("building the train step and the model state"):
        run, state = _setup(args)
    try:
        restored: list[Path] = []
        state, start_step = resume.restore(state, checkpoint_cfg.restore, run.model_dir,
                                           run.progress.message, restored.append)
        run.lineage = lineage.for_run(run.model_dir, (restored or [None])[0],
                                      run.args["random_seed"], state.params)
        run.events.emit("train_begin", step=start_step, model_dir=run.model_dir)
        step, state, stop = _loop(run, state, start_step)
        _finish(run, step, state, stop)
    finally:
        run.close()
    run.progress.message(f"finished at step {step}; checkpoints in {run.model_dir}")
    return step, state


def _check_arguments(a: dict[str, Any]) -> None:
    """T5X parameters the local engine does not implement, and step counts, as errors."""
    reject_unsupported("train_script.train", **{k: a[k] for k in (
        "use_hardware_rng", "get_dataset_fn", "train_eval_get_dataset_fn",
        "train_state_initializer_cls", "verify_matching_vocabs_fn")})
    require_value("train_script.train", "use_orbax", a["use_orbax"], True, "checkpoints with Orbax")
    require_value("train_script.train", "gc_period", a["gc_period"], 0,
                  "leaves garbage collection to Python")
    _check_counts(**{k: a[k] for k in ("total_steps", "eval_steps", "eval_period",
                                       "stats_period")})


def _setup(a: dict[str, Any]) -> tuple[_Run, TrainState]:
    """Check what can be checked, compile the step for shapes (its memory against the
    devices'), then build the state, the checkpointer and the loop's bookkeeping."""
    model, train_cfg, total = a["model"], a["train_dataset_cfg"], a["total_steps"]
    save_cfg = a["checkpoint_cfg"].save
    actions = check_actions(a["actions"], a["concurrent_metrics"],
                            a["infer_eval_dataset_cfg"] is not None)
    epoch = _periods_check(total, a["eval_period"], save_cfg.period if save_cfg else None)
    if a["random_seed"] is None:
        a["random_seed"] = random.SystemRandom().randint(0, 2**31 - 1)
    model_dir = str(Path(a["model_dir"]).absolute())
    # Process 0 writes metrics, the operative config and the progress line (as T5X); every
    # process trains, checkpoints (Orbax coordinates them) and decides when to stop alike.
    lead = jax.process_index() == 0
    progress = Progress(total) if lead else Progress(total, stream=io.StringIO())
    watch = monitor.MemoryWatch(a["memory_warn_fraction"], progress.message)
    features = batch_shapes(train_cfg, model)
    monitor.check_integer_sizes(model)
    monitor.check_host_sizes(train_cfg, a["train_eval_dataset_cfg"], a["eval_steps"],
                             len(features))
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(a["random_seed"]))
    batch_size, length = train_cfg.batch_size, max(train_cfg.task_feature_lengths.values())
    monitor.check_network_bound(model, length)
    getattr(model, "frozen_params", None)  # LoRA reads its base weights here, not mid-trace
    shapes, axes = state_shapes(model, batch_size, length)

    def make(batch: int | None = None, **stage: Any) -> Trainer:  # the run's, or a stage's
        return make_trainer(a["trainer_cls"], model, a["partitioner"], shapes, axes, dropout_rng,
                            batch or batch_size, model_dir, **trainer_features(a), **stage)

    trainer = make()
    stages = a["curriculum"] and StagePlan(staged.parse_stages(a["curriculum"], total), trainer,
                                           make, shapes.params)
    # Compiled here, before any array exists: a step that cannot fit is an error, not an
    # out-of-memory kill; the first train step then runs this executable.
    monitor.check_step_fits(trainer.lower_train_step(*placed_shapes(trainer, shapes, features))
                            .compile(), watch, batch_size)
    state = trainer.prepare_state(initial_state(model, init_rng, batch_size, length)[0])
    max_skips = trainer.max_consecutive_skips if trainer.skip_nonfinite_updates else None
    events = Events(actions)
    run = _Run(a, trainer, model_dir, epoch, a["stats_period"] or epoch, actions,
               EventWriter(MetricsWriter(model_dir) if lead else NullWriter(), events),
               progress, _window(a, state, lead, model_dir),
               NanGuard(max_skips, lambda: _last_good(run)), watch, events=events,
               stages=stages or None, infer=infer_eval.make(a, model_dir) if lead else None)
    return run, state


def _window(a: dict[str, Any], state: TrainState, lead: bool, model_dir: str) -> StepWindow:
    """The step window, with the analytic FLOPs per step and (process 0) the machine's peak."""
    model, cfg = a["model"], a["train_dataset_cfg"]
    length = max(cfg.task_feature_lengths.values())
    net_config = getattr(model.module, "config", None)
    flops = cfg.batch_size * length * model_flops_per_token(
        net_config, length, getattr(model.module, "moe_config", None))
    # One device's measured peak in the compute dtype times the devices the step runs on
    # (simulated CPU devices share the host's cores, so there MFU reads low).
    peak = run_peak_flops(model_dir, getattr(net_config, "dtype", "float32")) * \
        jax.device_count() if lead else 0.0
    return StepWindow(cfg.batch_size * length, flops, peak)


def _batches(run: _Run, start_step: int) -> Iterator[dict]:
    """Train batches from the data position `start_step` (the curriculum's stages if set)."""
    a = run.args
    cfg, converter = a["train_dataset_cfg"], a["model"].FEATURE_CONVERTER_CLS
    seed = cfg.seed if cfg.seed is not None else a["random_seed"]
    if run.stages:
        return staged.batches(run.stages.stages, cfg, converter, seed, start_step)
    return inputs.batches(cfg, converter, seed, skip_batches=start_step)


def _loop(run: _Run, state: TrainState, start_step: int) -> tuple[int, TrainState, bool]:
    """Train from start_step to total_steps (or until an action stops it, or a signal)."""
    if run.save_cfg:  # after the restore: Orbax lists the steps when it opens the dir
        run.saver = checkpoints.manager(run.model_dir, run.save_cfg.keep, async_save=True)
        run.saver.lineage = run.lineage
    train_iter = _batches(run, start_step)
    data_sharding = run.trainer.partitioner.data_sharding()
    run.eval_batches = [global_batch(b, data_sharding) for b in inputs.eval_batches(
        run.args["train_eval_dataset_cfg"], run.args["model"], run.args["eval_steps"])]
    step, stop = start_step, False
    if run.args["run_eval_before_training"]:
        stop = run.eval_batches and _evaluate_and_act(run, state, step)
        stop = (run.infer and infer_eval.evaluate_and_act(run, state, step)) or stop
    with Preemption() as preemption:
        while step < run.args["total_steps"] and not stop:
            host_batch = run.window.next_batch(train_iter)
            trainer = run.stages.trainer_at(step) if run.stages else run.trainer
            state = run.stages.apply(state, step) if run.stages else state
            state, metrics = trainer.train_step(state, global_batch(host_batch, data_sharding))
            step += 1
            run.window.add(metrics)
            run.guard.after_step(step, metrics)
            if step == start_step + 1:  # compiled: time steady-state steps from here
                _first_step(run, step)
            stop = _after_step(run, state, step)
            if preemption.requested(step):
                _preempted(run, state, step, preemption.signal_name)
    return step, state, stop


def _first_step(run: _Run, step: int) -> None:
    run.guard.check_now()
    if jax.process_index() == 0:
        run.args["summarize_config_fn"](run.model_dir, run.writer, step)
    total = run.args["total_steps"]
    run.progress.message(f"compiled and ran step {step}; training to step {total}")
    run.window.reset()


def _after_step(run: _Run, state: TrainState, step: int) -> bool:
    """Report, evaluate, checkpoint and run actions where T5X's schedule says; True: stop."""
    total = run.args["total_steps"]
    final = step == total
    end_of_epoch = step % run.epoch == 0 or final
    save_cfg, stop = run.save_cfg, False
    if run.window.steps and (step % run.stats_period == 0 or end_of_epoch):
        run.guard.check_now()
        m = run.window.flush(run.guard.skipped_total)
        m.update(monitor.memory_metrics())
        run.watch.check(m)
        run.writer.write(step, "train", m)
        run.progress.update(step, m["loss"], m["tokens_per_s"], m["step_time_s"],
                            m.get("data_wait_share"))
        stop = run_actions(run.actions.get("TRAIN", []), state, {"train": m})
    extra = run.saver and step in set(save_cfg.checkpoint_steps or ())
    if end_of_epoch:
        metrics_by_task = {}
        evaluating = final or step % (run.args["eval_period"] or total) == 0
        if run.eval_batches and evaluating:
            metrics_by_task = _train_eval(run, state, step)
        if run.infer and evaluating:
            stop = infer_eval.evaluate_and_act(run, state, step) or stop
        if run.saver and (final or step % (save_cfg.period or total) == 0):
            # The final save is waited for: TRAIN_EVAL actions (a consensus merge) read it.
            _save(run, state, step, "final" if final else "periodic", wait=final)
        elif extra:
            _save(run, state, step, "extra")
        run.events.saved(run.saver)  # saves committed so far (the final one waited for) first
        stop = run_actions(run.actions.get("TRAIN_EVAL", []), state, metrics_by_task) or stop
        run.window.reset()  # evaluation and checkpointing are not step time
    elif extra:  # T5X's checkpoint_steps: extra steps to save
        _save(run, state, step, "extra")
    run.events.saved(run.saver)
    return stop


def _save(run: _Run, state: TrainState, step: int, kind: str, wait: bool = False) -> None:
    """Checkpoint `step` (asynchronously unless `wait`); a state with NaN/Inf is refused
    and training stops naming the newest finite checkpoint."""
    run.guard.check_now()
    t0 = time.perf_counter()
    model = run.args["model"]  # it may add files to each checkpoint (LoRA: its base's pointer)
    sidecars = model.checkpoint_sidecars() if hasattr(model, "checkpoint_sidecars") else None
    try:
        with phases.phase(f"saving checkpoint_{step}"):
            run.saver.save(step, checkpoints.cast_floats(state.state_dict(), run.save_cfg.dtype),
                           kind, wait=wait, sidecars=sidecars)
    except checkpoints.NonFiniteState as err:
        run.guard.diverged(str(err))
    run.saved.add(step)
    run.window.pause(time.perf_counter() - t0)  # checkpointing is not step time


def _last_good(run: _Run) -> str:
    """The newest checkpoint of the model dir that exists and was checked finite, in words."""
    if run.saver:
        run.saver.wait()  # an in-flight save commits first
    return resume.newest_finite(run.model_dir)


def _preempted(run: _Run, state: TrainState, step: int, signal_name: str | None) -> None:
    """Save `step` (unless it just was) and leave with the preemption exit code."""
    saved = "no checkpoint is written (checkpointing is off)"
    if run.saver:
        if step not in run.saved:
            _save(run, state, step, "preemption", wait=True)
        run.events.saved(run.saver, wait=True)
        saved = f"{run.model_dir}/checkpoint_{step} holds every finished step"
    # Named: without model_dir the same command makes a new dated run dir, from step 0.
    message = f"preempted by {signal_name} after step {step}: {saved}; run the same command " \
        f"again with model_dir={run.model_dir} to resume"
    run.progress.message(message)
    run.events.emit("preemption", step=step,
                    path=f"{run.model_dir}/checkpoint_{step}" if run.saver else None)
    raise Preempted(message)


def _finish(run: _Run, step: int, state: TrainState, stop: bool) -> None:
    """A run an action stopped saves the step it stopped at; the operative config."""
    run.guard.check_now()
    if stop and run.saver and step not in run.saved | set(checkpoints.steps(run.model_dir)):
        _save(run, state, step, "stop")
    if jax.process_index() == 0:
        run.args["summarize_config_fn"](run.model_dir, run.writer, step)
    run.events.saved(run.saver, wait=True)
    run.events.emit("train_end", step=step, model_dir=run.model_dir)


def _evaluate_and_act(run: _Run, state: TrainState, step: int) -> bool:
    return run_actions(run.actions.get("TRAIN_EVAL", []), state, _train_eval(run, state, step))


def _train_eval(run: _Run, state: TrainState, step: int) -> dict[str, dict]:
    """One train-eval pass, written and shown; T5X's metrics_by_task for the actions."""
    run.guard.check_now()
    with phases.phase(f"evaluating at step {step}"):
        eval_m = summarize(sum_metrics([run.trainer.eval_step(state, b) for b in run.eval_batches]))
    run.writer.write(step, "train_eval", eval_m)
    run.progress.message(f"step {step}: eval loss {eval_m['loss']:.4f} "
                         f"accuracy {eval_m['accuracy']:.4f}")
    task = run.args["train_eval_dataset_cfg"].mixture_or_task_name
    return {task: eval_m}

