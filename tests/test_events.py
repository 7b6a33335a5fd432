"""Actions join, never replace: a user's `train_script.train.actions` binding (a --gin_file
or gin_bindings) is joined with the project's by mode, and says what it alone would have
dropped; callback events for train begin/end, checkpoint saved, preemption and merge; W&B
(offline) and MLflow (local SQLite store) as metric writers, on real tiny runs."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import gin
from capibara_exp import experiment
from capibara_exp.base.errors import Preempted
from capibara_exp.base.paths import GIN_DIR
from capibara_exp.composing import gin_bridge
from capibara_exp.runtime import gin_utils, train_script
from capibara_exp.runtime.events import Callback
from tests.conftest import compose_config
from tests.test_train import TINY

USER_GIN = """from __gin__ import dynamic_registration
import __main__ as train_script
from capibara_exp.runtime import loggers

train_script.train.actions = {'TRAIN_EVAL': [@loggers.MlflowLogger()]}
loggers.MlflowLogger.model_dir = %MODEL_DIR
"""


class Recorder(Callback):
    """Every event it hears, in order; SIGTERM to its own process at `preempt_at`."""

    def __init__(self, preempt_at: int | None = None):
        self.seen: list[tuple] = []
        self.preempt_at = preempt_at

    def run(self, train_state, metrics_by_task) -> bool:
        self.seen.append(("run", int(train_state.step)))
        if self.preempt_at is not None and int(train_state.step) >= self.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as a preempted VM's would
        return False

    def on_train_begin(self, step, model_dir):
        self.seen.append(("train_begin", step))

    def on_metrics(self, step, split, metrics):
        self.seen.append(("metrics", step, split))

    def on_checkpoint_saved(self, step, path):
        self.seen.append(("checkpoint_saved", step, Path(path).name))

    def on_preemption(self, step, path):
        self.seen.append(("preemption", step, Path(path).name))

    def on_train_end(self, step, model_dir):
        self.seen.append(("train_end", step))

    def on_merge(self, report):
        self.seen.append(("merge", len(report["candidates"])))


def _config(tmp_path: Path, *overrides: str):
    return compose_config([f"model_dir={tmp_path / 'run'}", *TINY, *overrides])


def test_a_user_actions_binding_joins_the_projects_and_says_what_it_would_drop(
        tmp_path, capsys) -> None:
    user = tmp_path / "user.gin"
    user.write_text(USER_GIN)
    cfg = _config(tmp_path, "early_stopping=default", f"gin_files=[{user}]",
                  "gin_bindings=[\"TRAIN_EVAL_ACTION_MINE = @trainer.EarlyStoppingAction()\"]")
    text = gin_bridge.render(cfg, "local", GIN_DIR)
    assert gin_bridge.body_of(text) == gin_bridge.body_of(gin_bridge.render(cfg, "t5x", GIN_DIR))
    path = experiment.write_gin(cfg, tmp_path / "run", {})
    err = capsys.readouterr().err
    assert ("gin_files[0] (" in err and "binds train_script.train.actions; joined with the "
            "project's actions instead of replacing them (alone it would have dropped "
            "TRAIN_EVAL: %TRAIN_EVAL_ACTION_CHECKSUMS, TRAIN_EVAL: "
            "%TRAIN_EVAL_ACTION_EARLY_STOPPING;") in err
    gin_utils.parse(path, path.read_text())
    bound = gin.get_bindings(train_script.train)["actions"]["TRAIN_EVAL"]
    assert [type(a).__name__ for a in bound] == [
        "ChecksumCheckpoints", "EarlyStoppingAction", "EarlyStoppingAction", "MlflowLogger"]


def test_early_stopping_still_stops_a_run_whose_user_gin_binds_actions(tmp_path, data_dir
                                                                        ) -> None:
    user = tmp_path / "user.gin"
    user.write_text(USER_GIN)
    cfg = _config(tmp_path, "early_stopping=default", "early_stopping.early_stopping_patience=1",
                  f"gin_files=[{user}]", "trainer.train_steps=6", "trainer.eval_period=2",
                  "checkpoint.checkpoint_period=2")
    step, _ = gin_utils.run_train(experiment.write_gin(cfg, tmp_path / "run", {}))
    assert step == 2  # patience 1: the first evaluation stops it (the user's binding kept it)
    assert (tmp_path / "run" / "mlflow.db").is_file()  # and the user's action ran


def _train(tmp_path: Path, recorder: Recorder, *overrides: str):
    cfg = _config(tmp_path, "trainer.train_steps=4", "trainer.eval_period=2",
                  "checkpoint.checkpoint_period=2", "checkpoint.checkpoints_to_keep=null",
                  *overrides)
    return gin_utils.run_train(experiment.write_gin(cfg, tmp_path / "run", {}),
                               actions={"TRAIN_EVAL": [recorder]})


def test_callbacks_hear_begin_metrics_checkpoints_merge_and_end(tmp_path, data_dir) -> None:
    recorder = Recorder()
    _train(tmp_path, recorder, "consensus=last_k", "consensus.merge_last_k=2")
    # Step 2's save commits in the background (whenever Orbax is done), the final one is
    # waited for: it is reported before the actions that read it (the merge) run.
    events = [e for e in recorder.seen if e[0] not in ("metrics", "run")]
    assert events == [("train_begin", 0), ("checkpoint_saved", 2, "checkpoint_2"),
                      ("checkpoint_saved", 4, "checkpoint_4"), ("merge", 2), ("train_end", 4)]
    assert recorder.seen.index(("merge", 2)) < recorder.seen.index(("run", 4))
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e[1:] for e in recorder.seen if e[0] == "metrics"] == [
        (r["step"], r["split"]) for r in records]


def test_callbacks_hear_a_preemption_and_the_resumed_run_begins_at_its_step(
        tmp_path, data_dir) -> None:
    recorder = Recorder(preempt_at=2)
    with pytest.raises(Preempted) as stopped:
        _train(tmp_path, recorder)
    assert recorder.seen[-1] == ("preemption", 2, "checkpoint_2")
    # the advice names the run dir: the command typed may not have (a new dated dir each time)
    assert f"again with model_dir={tmp_path / 'run'} to resume" in str(stopped.value)
    assert ("train_end", 2) not in recorder.seen
    again = Recorder()
    _train(tmp_path, again)
    assert again.seen[0] == ("train_begin", 2) and again.seen[-1] == ("train_end", 4)


def test_wandb_offline_and_mlflow_local_store_log_every_record(tmp_path, data_dir) -> None:
    from mlflow.tracking import MlflowClient

    cfg = _config(tmp_path, "wandb=offline", "mlflow=local", "trainer.train_steps=4",
                  "trainer.eval_period=2", "checkpoint.checkpoint_period=2")
    run_dir = tmp_path / "run"
    gin_utils.run_train(experiment.write_gin(cfg, run_dir, {}))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["loss"]) for r in records if r["split"] == "train_eval"]
    assert len(evals) == 2

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("capibara-exp").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train_eval/loss")
    assert [m.step for m in history] == [step for step, _ in evals]
    assert [m.value for m in history] == pytest.approx([loss for _, loss in evals], rel=1e-6)
    assert run.info.status == "FINISHED"
    assert run.data.tags["last_checkpoint"].endswith("checkpoint_4")

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    history, summary = wandb_records(next(offline.glob("*.wandb")))
    logged = [(step, row["train_eval/loss"]) for step, row in history if "train_eval/loss" in row]
    assert [s for s, _ in logged] == [s for s, _ in evals]
    assert [v for _, v in logged] == pytest.approx([v for _, v in evals], rel=1e-6)
    assert summary["last_checkpoint"].endswith("checkpoint_4") and "exit" in summary


def wandb_records(path: Path) -> tuple[list[tuple[int, dict]], dict]:
    """(history rows, summary updates and exit) of an offline W&B run's transaction log:
    LevelDB's log format (32 KiB blocks of records with a 7-byte header: checksum, length,
    type) after W&B's 7-byte file header, each record one of W&B's protobuf Records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    history, summary = [], {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending, which = b"", record.WhichOneof("record_type")
            if which == "history":
                history.append((record.history.step.num, {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item}))
            elif which == "summary":
                summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.summary.update})
            elif which == "exit":
                summary["exit"] = record.exit.exit_code
        elif length == 0 and kind == 0:
            break
    return history, summary
