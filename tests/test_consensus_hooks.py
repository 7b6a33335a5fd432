"""The consensus hooks on real tiny runs: the action in config.gin, resuming from a merge,
the capibara-exp-merge app's function, and the sweep soup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from capibara_exp import experiment
from capibara_exp.consensus import action as consensus_action
from capibara_exp.consensus.callback import soup_sweep
from capibara_exp.runtime import checkpoints, gin_utils, integrity
from capibara_exp.runtime.trainer import TrainState
from tests.conftest import compose_config
from tests.test_train import TINY

COMMON = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2",
          "checkpoint.checkpoints_to_keep=null", "consensus=last_k", "consensus.merge_last_k=2"]


def train(model_dir: Path, *overrides: str):
    cfg = compose_config([f"model_dir={model_dir}", *TINY, *overrides])
    return gin_utils.run_train(experiment.write_gin(cfg, model_dir, {}))


def test_last_k_action_is_bound_in_config_gin_for_both_engines() -> None:
    from capibara_exp.base.paths import GIN_DIR
    from capibara_exp.composing import gin_bridge

    cfg = compose_config([*TINY, *COMMON])
    local, t5x = (gin_bridge.render(cfg, e, GIN_DIR) for e in ("local", "t5x"))
    assert gin_bridge.body_of(local) == gin_bridge.body_of(t5x)
    body = gin_bridge.body_of(local)
    assert "TRAIN_EVAL_ACTION_CONSENSUS = @consensus.ConsensusMerge()" in body
    assert ("train_script.train.actions = {'TRAIN_EVAL': [%TRAIN_EVAL_ACTION_CHECKSUMS, "
            "%TRAIN_EVAL_ACTION_CONSENSUS]}") in body  # every run checksums its checkpoints
    assert "MERGE_LAST_K = 2" in body
    assert "ConsensusMerge" not in gin_bridge.body_of(gin_bridge.render(
        compose_config(TINY), "local", GIN_DIR))  # consensus=none adds nothing


@pytest.mark.parametrize("choice, actions", [
    ("last_k", ["ChecksumCheckpoints", "ConsensusMerge"]), ("sweep_soup", ["ChecksumCheckpoints"]),
    ("none", ["ChecksumCheckpoints"])])
def test_checksum_action_is_bound_identically_for_both_engines(tmp_path, choice, actions) -> None:
    """T5X writes no checksum manifests: every run binds an action that does (consensus
    choices add theirs), with the same gin under both engines."""
    import gin
    from capibara_exp.base.paths import GIN_DIR
    from capibara_exp.composing import gin_bridge

    cfg = compose_config([*TINY, *COMMON[:3], f"consensus={choice}"])
    local, t5x = (gin_bridge.render(cfg, e, GIN_DIR) for e in ("local", "t5x"))
    assert gin_bridge.body_of(local) == gin_bridge.body_of(t5x)
    assert all(f"@consensus.{action}()" in gin_bridge.body_of(t5x) for action in actions)
    (tmp_path / "config.gin").write_text(local)
    gin_utils.parse(tmp_path / "config.gin", local)
    bound = gin.get_bindings("train_script.train")["actions"]["TRAIN_EVAL"]
    assert [type(a).__name__ for a in bound] == actions
    assert all(isinstance(a, consensus_action.ChecksumCheckpoints) for a in bound)
    assert all(a.model_dir == Path(cfg.model_dir) for a in bound)


@pytest.mark.slow
def test_action_merges_last_k_once_and_training_resumes_from_the_merge(tmp_path, data_dir) -> None:
    run_dir, resumed = tmp_path / "run", tmp_path / "resumed"
    step, state = train(run_dir, "trainer.train_steps=4", *COMMON)
    report = json.loads((run_dir / "merged" / "merge_report.json").read_text())
    assert [c["step"] for c in report["candidates"]] == [2, 4]
    assert all(c["accepted"] for c in report["candidates"])
    merged = run_dir / "merged" / "checkpoint_4"
    assert integrity.verify_manifest(merged) == []
    # Resume a new run from the merged checkpoint and train on to step 6.
    step, state = train(resumed, "trainer.train_steps=6", "trainer.eval_period=2",
                        "checkpoint.checkpoint_period=2",
                        f"gin_bindings=[\"utils.RestoreCheckpointConfig.path = '{merged}'\", "
                        "\"utils.RestoreCheckpointConfig.mode = 'specific'\"]")
    assert step == 6 and checkpoints.steps(resumed) == [6]
    log = (resumed / "metrics.jsonl").read_text().splitlines()
    # From scratch the first record is step 2 (step 1 compiles); from step 4 it is step 6.
    assert json.loads(log[0])["step"] == 6


@pytest.mark.slow
def test_action_fires_exactly_once(tmp_path, data_dir) -> None:
    train(tmp_path, "trainer.train_steps=2", *COMMON[:3])  # two checkpoints, no action
    train(tmp_path, "trainer.train_steps=4", *COMMON[:3])
    act = consensus_action.ConsensusMerge(str(tmp_path), total_steps=4, last_k=2,
                                          require_manifest=True, max_val_loss_ratio=None)
    state = lambda s: TrainState(step=s, params=None, opt_state=None)  # noqa: E731
    assert act.run(state(2), {}) is False and act.fired_at is None
    assert not (tmp_path / "merged").exists()
    assert act.run(state(4), {}) is False and act.fired_at == 4
    written = (tmp_path / "merged" / "merge_report.json").stat().st_mtime_ns
    act.run(state(4), {})
    act.run(state(5), {})
    assert act.fired_at == 4
    assert (tmp_path / "merged" / "merge_report.json").stat().st_mtime_ns == written


@pytest.mark.slow
def test_sweep_soup_merges_each_trials_final_checkpoint(tmp_path, data_dir) -> None:
    for trial, lr in (("0", "1e-3"), ("1", "3e-3")):
        train(tmp_path / trial, "trainer.train_steps=2", "trainer.eval_period=2",
              "checkpoint.checkpoint_period=2", f"schedule.base_learning_rate={lr}")
    shutil.copytree(tmp_path / "0", tmp_path / "2")  # a third trial keeps the gate's median honest
    rep = soup_sweep(tmp_path, method="uniform")
    assert [c["name"] for c in rep["candidates"]] == ["trial 0", "trial 1", "trial 2"]
    assert (tmp_path / "merged" / "checkpoint_2" / "state").is_dir()
    assert (tmp_path / "merged" / "merge_metrics.png").is_file()


@pytest.mark.entry
@pytest.mark.slow
def test_multirun_with_sweep_soup_callback_merges_the_trials(tmp_path, data_dir) -> None:
    import subprocess
    import sys

    script = Path(sys.executable).parent / "capibara-exp"
    sweep = tmp_path / "sweep"
    cmd = [str(script), "-m", "consensus=sweep_soup",
           "hydra.callbacks.consensus_soup.method=uniform", *TINY, "trainer.train_steps=2",
           "trainer.eval_period=2", "checkpoint.checkpoint_period=2",
           "schedule.base_learning_rate=1e-3,3e-3", f"hydra.sweep.dir={sweep}",
           f"data_dir={data_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "merged 2 of 2 trials (2 passed the gate)" in done.stderr
    report = json.loads((sweep / "merged" / "merge_report.json").read_text())
    assert [c["name"] for c in report["candidates"]] == ["trial 0", "trial 1"]
    assert report["method"]["method"] == "uniform"
