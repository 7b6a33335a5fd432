"""Metric writers beyond TensorBoard, as callbacks: Weights & Biases (offline by default)
and MLflow (a local store by default: an SQLite file, MLflow's maintained local backend;
its plain-file store is in maintenance mode and refused by MLflow 3 unless asked for).
Neither needs a network: W&B writes its run under MODEL_DIR/wandb (`wandb sync` uploads
it later), MLflow to MODEL_DIR/mlflow.db (`mlflow ui --backend-store-uri
sqlite:///MODEL_DIR/mlflow.db` shows it).

Under the local engine every metrics record (train and train_eval), each committed
checkpoint, a preemption, a consensus merge and the end of training reach them as events
(runtime/events.py). A run that resumes continues the same W&B or MLflow run (its id
follows from the model dir). Under real T5X, which calls only `run`, they log the
train-eval metrics they are given.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capibara_exp.runtime.events import Callback

LOCAL_STORE = "mlflow.db"  # MLflowLogger's default store, in the model dir

def _run_id(model_dir: str) -> str:
    return hashlib.sha256(str(Path(model_dir).absolute()).encode()).hexdigest()[:16]


def _flat(split: str, metrics: Mapping[str, float]) -> dict[str, float]:
    return {f"{split}/{k}": float(v) for k, v in metrics.items()}


class _Logger(Callback):
    """What both share: starting lazily (T5X calls only `run`), and T5X's fallback."""

    def __init__(self, model_dir: str):
        self.model_dir = str(Path(model_dir).absolute())
        self.started = False

    def _start(self) -> None:
        raise NotImplementedError

    def _log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Any]) -> bool:
        if self.events is None and metrics_by_task:  # real T5X: no events, log what it gives
            self._ensure_started()
            for task, metrics in metrics_by_task.items():
                self._log(int(train_state.step), _flat(f"train_eval/{task}", {
                    k: float(getattr(v, "compute", lambda v=v: v)()) for k, v in metrics.items()}))
        return False

    def _ensure_started(self) -> None:
        if not self.started:
            self._start()
            self.started = True

    def on_train_begin(self, step: int, model_dir: str) -> None:
        self._ensure_started()

    def on_metrics(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        self._ensure_started()
        self._log(step, _flat(split, metrics))

    def on_merge(self, report: Mapping[str, Any]) -> None:
        loss = report.get("held_out_loss") or report.get("val_loss") or {}
        values = {f"merge/{k}": float(v) for k, v in loss.items() if v is not None}
        if values:
            self._ensure_started()
            self._log(max(c["step"] for c in report["candidates"]), values)


class WandbLogger(_Logger):
    """Weights & Biases: `mode` 'offline' (default, no network), 'online' or 'disabled'."""

    def __init__(self, model_dir: str, project: str = "capibara-exp", mode: str = "offline",
                 name: str | None = None):
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"loggers.WandbLogger.mode must be 'offline', 'online' or "
                             f"'disabled', got {mode!r}")
        super().__init__(model_dir)
        self.project, self.mode, self.name = project, mode, name
        self.wandb_run: Any = None

    def _start(self) -> None:
        import wandb

        self.wandb_run = wandb.init(
            project=self.project, mode=self.mode, dir=self.model_dir, id=_run_id(self.model_dir),
            name=self.name or Path(self.model_dir).name, resume="allow",
            config={"model_dir": self.model_dir}, settings=wandb.Settings(
                console="off", silent=True, x_disable_stats=True))

    def _log(self, step: int, values: dict[str, float]) -> None:
        self.wandb_run.log(values, step=step)

    def on_checkpoint_saved(self, step: int, path: str) -> None:
        self._ensure_started()
        self.wandb_run.summary["last_checkpoint"] = path

    def on_preemption(self, step: int, path: str | None) -> None:
        self._finish(exit_code=75)  # the run continues when the command is run again

    def on_train_end(self, step: int, model_dir: str) -> None:
        self._finish(exit_code=0)

    def _finish(self, exit_code: int) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run, self.started = None, False


class MlflowLogger(_Logger):
    """MLflow through its client: `tracking_uri` (default: the local store
    sqlite:///MODEL_DIR/mlflow.db), one experiment, one MLflow run per model dir."""

    def __init__(self, model_dir: str, experiment_name: str = "capibara-exp",
                 tracking_uri: str | None = None, run_name: str | None = None):
        super().__init__(model_dir)
        self.tracking_uri = tracking_uri or f"sqlite:///{Path(self.model_dir) / LOCAL_STORE}"
        self.experiment_name, self.run_name = experiment_name, run_name
        self.client: Any = None
        self.run_id: str | None = None

    def _start(self) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment_name)
        experiment_id = found.experiment_id if found else \
            self.client.create_experiment(self.experiment_name)
        tag = _run_id(self.model_dir)
        same = self.client.search_runs([experiment_id],
                                       filter_string=f"tags.capibara_run = '{tag}'")
        if same:  # a resumed training continues its MLflow run
            self.run_id = same[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                experiment_id, run_name=self.run_name or Path(self.model_dir).name,
                tags={"capibara_run": tag, "model_dir": self.model_dir}).info.run_id

    def _log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in values.items()])

    def on_checkpoint_saved(self, step: int, path: str) -> None:
        self._ensure_started()
        self.client.set_tag(self.run_id, "last_checkpoint", path)

    def on_preemption(self, step: int, path: str | None) -> None:
        self._end("KILLED")

    def on_train_end(self, step: int, model_dir: str) -> None:
        self._end("FINISHED")

    def _end(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
            self.started = False
