"""engine=t5x: real T5X trains the rendered config.gin, and the run dir ends as the local
engine leaves it: metrics.jsonl (the same keys and meanings), TensorBoard events under
train/ and train_eval/, checksum manifests (the checksum action in config.gin), config.gin
as rendered and T5X's operative config as operative_config.gin.

T5X runs in a child process: `python -m capibara_exp.launch.t5x_main` runs T5X's own
t5x.train module with capibara-exp's process set-up (quiet unless verbose, compile progress).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from capibara_exp.base.errors import ConfigError, RunError
from capibara_exp.launch import t5x_data

CONFIG_GIN = "config.gin"
OPERATIVE_CONFIG = "operative_config.gin"
METRICS = "metrics.jsonl"
T5X_EVAL_DIR = "training_eval"  # T5X's train-eval summaries: training_eval/<task>/
EVAL_DIR = "train_eval"  # the local engine's, and the run dir's
VERBOSE_ENV = "CAPIBARA_VERBOSE"
RUN_LOG_ENV = "CAPIBARA_RUN_LOG"
RUN_LOG = "capibara-exp.log"  # Hydra's job log in the run dir (hydra.job.name)


def command(python: str | None, gin_path: Path, flags: list[str]) -> list[str]:
    """The child's command: `engine.python` (default: this interpreter)."""
    return [python or sys.executable, "-m", "capibara_exp.launch.t5x_main",
            f"--gin_file={gin_path}", *flags]


def run(cmd: list[str], gin_path: Path, run_dir: Path, total_steps: int, verbose: bool,
        compilation_cache_dir: str | None = None) -> dict | None:
    """Run T5X; then metrics.jsonl and train_eval/ as the local engine writes them. Returns
    the last train_eval metrics."""
    rendered = gin_path.read_text()
    env = {**os.environ, VERBOSE_ENV: "1" if verbose else "0",
           RUN_LOG_ENV: str(run_dir / RUN_LOG)}  # T5X's Python log joins the run's
    if compilation_cache_dir:  # JAX reads these at start: T5X's compiles go in the cache too
        env.update(JAX_COMPILATION_CACHE_DIR=str(compilation_cache_dir),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    waits = tempfile.NamedTemporaryFile(prefix="capibara-data-wait-", delete=False)  # noqa: SIM115
    waits.close()
    env[t5x_data.WAIT_FILE_ENV] = waits.name  # the child's time in next() (launch/t5x_data.py)
    watcher = _Progress(run_dir, total_steps, waits.name)
    _say(f"T5X trains {gin_path} to step {total_steps} (t5x.train in a child process; its "
         f"Python log goes to {run_dir / RUN_LOG})")
    try:
        result = subprocess.run(cmd, check=False, env=env)
    finally:
        watcher.stop()
        keep_rendered_config(gin_path, rendered, run_dir)
        write_metrics(run_dir, t5x_data.WaitLog(waits.name).update())
        os.unlink(waits.name)
        write_inference_metrics(run_dir)
        move_train_eval_events(run_dir)
    if result.returncode:
        raise RunError(f"t5x.train exited with status {result.returncode}; see its output above")
    evaluation = last_train_eval(run_dir)
    if evaluation and "loss" in evaluation:  # the local engine's eval line, for the last one
        _say(f"step {evaluation['step']}: eval loss {evaluation['loss']:.4f}"
             + (f" accuracy {evaluation['accuracy']:.4f}" if "accuracy" in evaluation else ""))
    from capibara_exp.runtime.metrics import final_metrics

    return final_metrics(run_dir) or evaluation


def resume_bindings(model_dir: Path, initial_checkpoint: str | None = None) -> list[str]:
    """Gin bindings T5X needs to continue model_dir, or to start from an initial checkpoint:
    none, unless the checkpoint it restores keeps no tf.data iterator (one the local engine,
    an import or a merge wrote). T5X then starts from its parameters with its data stream
    from the beginning (and says so), instead of failing on the missing `dataset` item."""
    steps = sorted(int(d.name.split("_")[1]) for d in model_dir.glob("checkpoint_*")
                   if d.name.split("_")[1].isdigit() and (d / "state").is_dir())
    source = (model_dir / f"checkpoint_{steps[-1]}" if steps else
              Path(initial_checkpoint) if initial_checkpoint else None)
    if source is None or (source / "dataset").is_dir():
        return []
    print(f"capibara-exp: {source} keeps no tf.data iterator (the local engine, an import or "
          "a merge wrote it): T5X continues from its parameters with its data stream from "
          "the beginning", file=sys.stderr)
    return ["utils.SaveCheckpointConfig.save_dataset = False"]


def keep_rendered_config(gin_path: Path, rendered: str, model_dir: Path) -> None:
    """T5X writes its operative config to MODEL_DIR/config.gin: keep it as the run dir's
    operative_config.gin, and config.gin the rendered file that ran."""
    written = model_dir / CONFIG_GIN
    if written.is_file() and written.read_text() != rendered:
        (gin_path.parent / OPERATIVE_CONFIG).write_text(written.read_text())
    if not gin_path.is_file() or gin_path.read_text() != rendered:
        gin_path.write_text(rendered)


def _events(directory: Path) -> list[tuple[int, float, dict[str, float]]]:
    """(step, wall time, scalars) of the TensorBoard event files in a directory, by step."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    steps: dict[int, tuple[float, dict[str, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = event_pb2.Event.FromString(record.numpy())
            for value in event.summary.value:
                scalar = _scalar(value)
                if scalar is not None:
                    time, scalars = steps.setdefault(int(event.step), (event.wall_time, {}))
                    scalars[value.tag] = scalar
    return [(step, time, scalars) for step, (time, scalars) in sorted(steps.items())]


def _scalar(value: Any) -> float | None:
    if value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
        import tensorflow as tf

        return float(tf.make_ndarray(value.tensor))
    if value.HasField("simple_value"):
        return float(value.simple_value)
    return None


# Train-record keys only the local engine measures: T5X's summaries have no gradient norm,
# no FLOPs and no memory figures (memory/* keys, where the backend has them). The data wait
# is measured around T5X's train iterator (launch/t5x_data.py).
LOCAL_ONLY = ("grad_norm", "mfu", "mfu_peak_flops")


def local_metrics(t5x: dict[str, float], split: str = "train") -> dict[str, float]:
    """T5X's summaries under the local engine's names and meanings (runtime/metrics.py): loss,
    cross-entropy and z-loss per non-padding target token, accuracy, perplexity and real
    target tokens; for train also learning rate, step time, real tokens per second and
    packing fill. The same keys as the local engine's records but LOCAL_ONLY."""
    fraction = t5x.get("non_padding_fraction/loss_weights") or 1.0
    out: dict[str, float] = {}
    if "loss_per_nonpadding_target_token" in t5x:
        out["loss"] = t5x["loss_per_nonpadding_target_token"]
    for name in ("cross_ent_loss", "z_loss"):
        if f"{name}_per_all_target_tokens" in t5x:
            out[name] = t5x[f"{name}_per_all_target_tokens"] / fraction
    if "accuracy" in t5x:
        out["accuracy"] = t5x["accuracy"]
    if "cross_ent_loss" in out:
        out["perplexity"] = math.exp(min(out["cross_ent_loss"], 50.0))
    if "learning_rate/current" in t5x or "learning_rate" in t5x:
        out["learning_rate"] = t5x.get("learning_rate/current", t5x.get("learning_rate"))
    if "timing/target_tokens_per_second" in t5x and "timing/seconds" in t5x:
        # all token slots per second x the seconds they were counted over x the real share
        out["target_tokens"] = float(round(t5x["timing/target_tokens_per_second"]
                                           * t5x["timing/seconds"] * fraction))
    if split == "train_eval":  # the local engine times only training
        return out
    if t5x.get("timing/steps_per_second"):
        out["step_time_s"] = 1.0 / t5x["timing/steps_per_second"]
    if "timing/target_tokens_per_second" in t5x:
        out["tokens_per_s"] = t5x["timing/target_tokens_per_second"] * fraction
    if "non_padding_fraction/loss_weights" in t5x:
        out["packing_fill"] = fraction  # real target tokens over the batch's token slots
    return out


def write_metrics(run_dir: Path, waits: t5x_data.WaitLog | None = None) -> None:
    """Append T5X's new train and train-eval summaries to metrics.jsonl (steps it has not
    recorded yet), in the local engine's format; a train record's data wait share from
    `waits` (launch/t5x_data.py) over its summary window, where they cover it."""
    path = run_dir / METRICS
    done = _recorded_steps(run_dir)
    sources = {"train": [run_dir / "train"],
               "train_eval": sorted((run_dir / T5X_EVAL_DIR).glob("*")) + [run_dir / EVAL_DIR]}
    records, starts = [], set()
    for split, dirs in sources.items():
        for directory in dirs:
            for step, wall, scalars in _events(directory) if directory.is_dir() else []:
                if "timing/init_or_restore_seconds" in scalars:
                    starts.add(step)  # an invocation started (or resumed) here
                metrics = local_metrics(scalars, split)
                share = waits.share(wall, scalars.get("timing/seconds", 0.0)) if waits else None
                if split == "train" and share is not None:
                    metrics["data_wait_share"] = share
                if "loss" in metrics and step > done.get(split, -1):
                    records.append({"step": step, "split": split, "time": wall, **metrics})
    # The local engine reports no train record for the first step of an invocation (its
    # compile step, not timed): neither does this.
    records = [r for r in records if not (r["split"] == "train" and r["step"] - 1 in starts)]
    records.sort(key=lambda r: (r["step"], r["split"] != "train"))
    with path.open("a") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")


def write_inference_metrics(run_dir: Path) -> None:
    """seqio's JSON logger lines (inference_eval/<task>-metrics.jsonl) into metrics.jsonl as
    the local engine writes them: split 'inference_eval', keys '<task>/<metric>'."""
    done = _recorded_steps(run_dir).get("inference_eval", -1)
    by_step: dict[int, dict] = {}
    wall = 0.0
    for path in sorted((run_dir / "inference_eval").glob("*-metrics.jsonl")):
        task, wall = path.name[:-len("-metrics.jsonl")], max(wall, path.stat().st_mtime)
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(int(row["step"]), {}).update(
                {f"{task}/{k}": float(v) for k, v in row.items()
                 if k != "step" and isinstance(v, (int, float))})
    with (run_dir / METRICS).open("a") as out:
        for step in sorted(s for s in by_step if s > done):
            out.write(json.dumps({"step": step, "split": "inference_eval", "time": wall,
                                  **by_step[step]}) + "\n")


def _recorded_steps(run_dir: Path) -> dict[str, int]:
    """The last step metrics.jsonl holds, per split."""
    done: dict[str, int] = {}
    path = run_dir / METRICS
    from capibara_exp.base.metrics_file import read_records

    for record in read_records(path)[0] if path.is_file() else []:
        done[record["split"]] = max(done.get(record["split"], -1), record["step"])
    return done


def move_train_eval_events(run_dir: Path) -> None:
    """T5X's training_eval/<task>/ event files into train_eval/ (the local engine's layout; a
    mixture's several tasks keep a subdirectory each)."""
    tasks = [d for d in sorted((run_dir / T5X_EVAL_DIR).glob("*")) if d.is_dir()]
    for task in tasks:
        target = run_dir / EVAL_DIR / ("" if len(tasks) == 1 else task.name)
        target.mkdir(parents=True, exist_ok=True)
        for event_file in task.glob("events.out.tfevents.*"):
            shutil.move(str(event_file), target / event_file.name)
        if not any(task.iterdir()):
            task.rmdir()
    if (run_dir / T5X_EVAL_DIR).is_dir() and not any((run_dir / T5X_EVAL_DIR).iterdir()):
        (run_dir / T5X_EVAL_DIR).rmdir()


def last_train_eval(run_dir: Path) -> dict | None:
    path = run_dir / METRICS
    last = None
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record["split"] == "train_eval":
            last = record
    if last is None:
        return None
    return {k: v for k, v in last.items() if k not in ("split", "time")}


class _Progress:
    """The local engine's progress lines for a T5X run, read from its train summaries."""

    PERIOD_S = 5.0

    def __init__(self, run_dir: Path, total_steps: int, waits: str | None = None):
        self.run_dir, self.total_steps = run_dir, total_steps
        self.waits = t5x_data.WaitLog(waits)
        self.shown = _recorded_steps(run_dir).get("train", -1)  # shown by an earlier run
        from capibara_exp.runtime.metrics import Progress

        self.line = Progress(total_steps)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="t5x-progress")
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(self.PERIOD_S):
            self.show()

    def show(self) -> None:
        directory = self.run_dir / "train"
        try:
            events = _events(directory) if directory.is_dir() else []
        except Exception:  # a file T5X is writing: read it next time
            return
        self.waits.update()
        for step, wall, scalars in events:
            m = local_metrics(scalars)
            if step > self.shown and "loss" in m:
                # The local engine's line, from T5X's own timing summaries; the data wait
                # from the timed train iterator (launch/t5x_data.py) over the same window.
                share = self.waits.share(wall, scalars.get("timing/seconds", 0.0))
                self.line.update(step, m["loss"], m.get("tokens_per_s", 0.0),
                                 m.get("step_time_s", 0.0), share)
                self.shown = step

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.show()


def _say(message: str) -> None:
    from capibara_exp.base.environment import copy_to_run_log

    print(f"capibara-exp: {message}", file=sys.stderr, flush=True)
    copy_to_run_log(f"capibara-exp: {message}")


def check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("t5x") is None:
        raise ConfigError(INSTALL_HINT)


INSTALL_HINT = ("T5X is not installed in this environment. It is not on PyPI; into this venv "
                "(any machine, CPU too): pip install --no-deps "
                "'git+https://github.com/google-research/t5x' "
                "'git+https://github.com/google/airio' "
                "'git+https://github.com/google-research/jestimator' && pip install fiddle chex "
                "jaxtyping cached_property grain tensorboard (docs/t5x_engine.md, Installing "
                "T5X); engine=local trains the same config.gin without it.")
