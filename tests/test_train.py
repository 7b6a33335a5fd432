"""Tiny real trainings through config.gin: two steps, stop-and-resume equality, NaN guard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from capibara_exp import experiment
from capibara_exp.base.errors import ConfigError
from capibara_exp.runtime import actions, checkpoints, gin_utils, resume
from capibara_exp.runtime.metrics import Progress
from capibara_exp.runtime.resume import NoVerifiedCheckpoint
from capibara_exp.runtime.train_script import TrainingDiverged
from capibara_exp.runtime.trainer import BaseAction
from capibara_exp.runtime.utils import (
    DatasetConfig,
    RestoreCheckpointConfig,
    SaveCheckpointConfig,
)
from tests.conftest import compose_config

TINY = ["model.emb_dim=32", "model.num_heads=2", "model.head_dim=16", "model.mlp_dim=64",
        "data.batch_size=4", "data.task_feature_lengths={targets: 64}", "trainer.eval_steps=1",
        "trainer.stats_period=1", "schedule.warmup_steps=2"]


def train(model_dir: Path, *overrides: str):
    """Compose, render and run config.gin like the CLI does (in this process): the data it
    reads prepared first (experiment.prepare_data; the tasks only read)."""
    cfg = compose_config([f"model_dir={model_dir}", *TINY, *overrides])
    path = experiment.write_gin(cfg, model_dir, {}, lambda: experiment.prepare_data(cfg))
    return gin_utils.run_train(path)


def read_checkpoint(model_dir: Path, step: int) -> dict:
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(model_dir / f"checkpoint_{step}" / "state")


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb, strict=True))


@pytest.mark.entry
def test_two_step_training_writes_checkpoint_metrics_and_configs(
        tmp_path: Path, corpus_data) -> None:
    step, state = train(tmp_path, "trainer.train_steps=2", "trainer.eval_period=2",
                        "checkpoint.checkpoint_period=2")
    assert step == 2 and int(state.step) == 2
    assert checkpoints.steps(tmp_path) == [2]
    tree = read_checkpoint(tmp_path, 2)
    assert set(tree) == {"state", "target"} and set(tree["state"]) == {"step", "param_states"}
    assert int(tree["state"]["step"]) == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "train_eval"]
    assert evals and np.isfinite(evals[-1]["loss"]) and 0 <= evals[-1]["accuracy"] <= 1
    last = [r for r in records if r["split"] == "train"][-1]  # memory beside the step metrics
    assert 1e7 < last["memory/host_rss_bytes"] <= last["memory/host_rss_peak_bytes"] \
        < last["memory/host_limit_bytes"]
    info = json.loads((tmp_path / "checkpoint_2" / "capibara_manifest.json").read_text())["info"]
    assert info == {"step": 2, "kind": "final", "finite": True, "lineage": [
        {"id": info["lineage"][0]["id"], "from": "initialisation with seed 0"}]}
    assert (tmp_path / "config.gin").exists()
    operative = (tmp_path / "operative_config.gin").read_text()
    assert "EMB_DIM = 32" in operative and "nets.DecoderConfig.emb_dim = %EMB_DIM" in operative
    assert list((tmp_path / "train").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_stop_and_resume_ends_with_the_uninterrupted_parameters(
        tmp_path: Path, corpus_data) -> None:
    common = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2",
              "checkpoint.checkpoints_to_keep=null"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(straight, "trainer.train_steps=6", *common)
    train(stopped, "trainer.train_steps=4", *common)
    at_4, final = read_checkpoint(stopped, 4), read_checkpoint(straight, 6)
    assert not leaves_equal(at_4["target"], final["target"])  # resuming has work to do
    assert leaves_equal(at_4, read_checkpoint(straight, 4))
    step, _ = train(stopped, "trainer.train_steps=6", *common)  # same command, longer
    assert step == 6
    assert leaves_equal(read_checkpoint(stopped, 6), final)  # bitwise, optimizer state included


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path, corpus_data) -> None:
    common = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2"]
    train(tmp_path, "trainer.train_steps=2", *common)
    good = read_checkpoint(tmp_path, 2)
    with pytest.raises(TrainingDiverged, match="NaN/Inf at step"):
        train(tmp_path, "trainer.train_steps=8", "schedule.base_learning_rate=1e30",
              "schedule.lr_factors=constant", "optimizer.grad_clip_norm=1e30", *common)
    assert checkpoints.steps(tmp_path) == [2]
    assert leaves_equal(read_checkpoint(tmp_path, 2), good)


@pytest.mark.slow
def test_no_checkpoint_verifying_is_an_error_naming_each(tmp_path: Path, corpus_data) -> None:
    common = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2"]
    train(tmp_path, "trainer.train_steps=2", *common)
    data_files = [p for p in (tmp_path / "checkpoint_2" / "state").rglob("*")
                  if p.is_file() and p.stat().st_size > 1000]
    assert data_files
    for path in data_files:  # truncate the array data
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    with pytest.raises(NoVerifiedCheckpoint, match=r"no checkpoint in .* verifies.*checkpoint_2: "
                                                   r".*\(truncated or rewritten\)"):
        train(tmp_path, "trainer.train_steps=4", *common)
    assert checkpoints.steps(tmp_path) == [2]  # nothing to fall back to: left where it was


@pytest.mark.slow
def test_checkpoint_steps_add_saves_and_only_the_last_n_are_kept(
        tmp_path: Path, corpus_data) -> None:
    # T5X's checkpoint_steps: step 3 is saved although the period is 2 (saves: 2, 3, 4, 6).
    train(tmp_path, "trainer.train_steps=6", "trainer.eval_period=2",
          "checkpoint.checkpoint_period=2", "checkpoint.checkpoints_to_keep=3",
          "gin_bindings=['utils.SaveCheckpointConfig.checkpoint_steps = [3]']")
    assert checkpoints.steps(tmp_path) == [3, 4, 6]


@pytest.mark.parametrize("override, message", [
    ("data.batch_size=1e9", r"\(from conf key data.batch_size\): utils.DatasetConfig.batch_size "
                            r"must be an integer, got 1000000000.0"),
    ("data.batch_size=1000000000", r"\(from conf key data.batch_size\): .*its host batches "
                                   r"need about .* GiB .*, more than the .* GiB this host has"),
    ("trainer.eval_steps=1000000000", r"\(from conf key trainer.eval_steps\): .*the eval "
                                      r"batches, held in memory .*, need about"),
    ("model.num_layers=100000", r"\(from conf key model.num_layers\): .*num_layers=100000 "
                                r"unrolled .*set model.scan_layers=true"),
    ("model.num_layers=100000000", r"\(from conf key model.num_layers\): .*num_layers=100000000"
                                   r" .*need at least .* GiB per device, more than the"),
    ("data.batch_size=1024", r"\(from conf key data.batch_size\): .*batch_size=1024: the train "
                             r"step needs .* GiB per device \(XLA's memory analysis of the "
                             r"compiled step\), more than the .* GiB available"),
])
def test_sizes_that_cannot_fit_fail_before_anything_is_allocated(tmp_path, override,
                                                                 message) -> None:
    # 1024 x 2048 tokens: small host batches, small parameters, but attention scores of
    # 1024 x 2 x 2048^2 floats per layer: only the compiled step's analysis sees them.
    extra = ["data.task_feature_lengths={targets: 2048}"] if "1024" in override else []
    with pytest.raises(ConfigError, match=message) as err:
        train(tmp_path, "trainer.train_steps=2", override, *extra)
    assert "\n" not in str(err.value) and not checkpoints.steps(tmp_path)


def test_a_one_step_run_still_evaluates_and_checkpoints(tmp_path: Path, corpus_data) -> None:
    step, _ = train(tmp_path, "trainer.train_steps=1", "trainer.eval_period=1",
                    "checkpoint.checkpoint_period=1")
    assert step == 1 and checkpoints.steps(tmp_path) == [1]
    splits = [json.loads(line)["split"]
              for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "train_eval" in splits


def test_periods_follow_t5x_rules() -> None:
    from capibara_exp.runtime.train_script import _periods_check

    assert _periods_check(100, eval_period=20, save_period=10) == 10
    assert _periods_check(100, eval_period=None, save_period=None) == 100
    with pytest.raises(ValueError, match=r"eval_period=3 is not a multiple of 2"):
        _periods_check(100, eval_period=3, save_period=2)


class Record(BaseAction):
    """An action that writes down when it ran and with which metrics."""

    def __init__(self):
        self.calls: list[tuple[int, dict]] = []

    def run(self, train_state, metrics_by_task) -> bool:
        self.calls.append((int(train_state.step), dict(metrics_by_task)))
        return False


def test_gin_bound_actions_and_a_callers_actions_both_run(tmp_path: Path, corpus_data) -> None:
    """A sweep trial's pruning action joins the actions config.gin binds (here early stopping);
    T5X's run_eval_before_training evaluates (and runs TRAIN_EVAL actions) at the start step,
    and TRAIN actions get each train report when metrics are not concurrent."""
    # mode=max on a falling loss: the bound EarlyStoppingAction stops after three evaluations
    # without improvement (before training, after step 1, after step 2). The first update is
    # tiny (warm-up), so step 1's loss can sit a rounding error above step 0's: atol makes
    # such a change no improvement, as it is meant to.
    cfg = compose_config([f"model_dir={tmp_path}", *TINY, "early_stopping=default",
                          "early_stopping.early_stopping_mode=max",
                          "early_stopping.early_stopping_atol=1e-3",
                          "early_stopping.early_stopping_patience=3", "trainer.train_steps=6",
                          "trainer.eval_period=1", "checkpoint.checkpoint_period=6",
                          "gin_bindings=['train_script.train.run_eval_before_training = True', "
                          "'train_script.train.concurrent_metrics = False']"])
    path = experiment.write_gin(cfg, tmp_path, {})
    on_eval, on_train = Record(), Record()
    step, _ = gin_utils.run_train(path, actions={"TRAIN_EVAL": [on_eval], "TRAIN": [on_train]})
    assert step == 2  # the bound action stopped the run
    assert [s for s, _ in on_eval.calls] == [0, 1, 2]  # the caller's ran at every evaluation
    assert all(list(m) == ["capibara_bytes_lm"] for _, m in on_eval.calls)
    # step 1's report is the compile step's, left out of the timings: the first is step 2's
    assert [s for s, _ in on_train.calls] == [2]
    assert list(on_train.calls[0][1]) == ["train"] and "loss" in on_train.calls[0][1]["train"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train_eval"] == [0, 1, 2]


_UNSUPPORTED = [
    ("utils.SaveCheckpointConfig.keep_dataset_checkpoints = 2",
     "keep_dataset_checkpoints=2 is a T5X parameter the local engine does not support"),
    ("utils.SaveCheckpointConfig.checkpoint_steps = [0, 5]",
     "checkpoint_steps must be a list of positive step numbers, got [0, 5]"),
    ("utils.RestoreCheckpointConfig.mode = 'all'",
     "utils.RestoreCheckpointConfig.mode: 'all' is not supported by the local engine"),
    ("utils.RestoreCheckpointConfig.restore_dataset = True",
     "restore_dataset=True is a T5X parameter the local engine does not support"),
    ("utils.RestoreCheckpointConfig.assignment_map = [('a', 'b')]",
     "assignment_map=[('a', 'b')] is a T5X parameter the local engine does not support"),
    ("train/utils.DatasetConfig.use_memory_cache = False",
     "use_memory_cache=False is not supported by the local engine, which always keeps"),
    ("train_script.train.use_orbax = False",
     "use_orbax=False is not supported by the local engine, which always checkpoints with Orbax"),
    ("train_script.train.gc_period = 100",
     "gc_period=100 is not supported by the local engine"),
    ("train_script.train.actions = {'EVAL': []}", "modes ['EVAL'] are not T5X's action modes"),
]


@pytest.mark.parametrize("binding, message", _UNSUPPORTED)
def test_unsupported_t5x_parameters_are_errors_naming_the_binding(binding: str, message: str,
                                                                  tmp_path: Path,
                                                                  corpus_data) -> None:
    """Raised while gin builds the configs or as train starts: nothing trains."""
    cfg = compose_config([f"model_dir={tmp_path}", *TINY, f"gin_bindings=[\"{binding}\"]"])
    path = experiment.write_gin(cfg, tmp_path, {})
    key = binding.split(" =")[0]
    with pytest.raises(ConfigError, match=rf"config.gin:\d+ \(from gin_bindings\[0\], "
                                          rf"{re.escape(key)}\): .*{re.escape(message)}"):
        gin_utils.run_train(path)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, actions, message", [
    (["model.num_heads=0"], None,
     r"config.gin:\d+ \(from conf key model.num_heads\): DecoderConfig.num_heads must be "
     r"positive, got 0 \(in DecoderConfig"),
    (["trainer.num_microbatches=3"], None,
     r"\(from conf key trainer.num_microbatches\): batch size 4 does not divide by"),
    ([], {"INFER_EVAL": [Record()]}, r"actions\['INFER_EVAL'\] would never run"),
    ([], {"TRAIN": [Record()]}, r"actions\['TRAIN'\] needs train_script.train."
                                r"concurrent_metrics = False"),
])
def test_config_mistakes_found_when_gin_builds_objects_are_one_line_errors(
        overrides: list[str], actions: dict | None, message: str, tmp_path: Path,
        corpus_data) -> None:
    cfg = compose_config([f"model_dir={tmp_path}", *TINY, *overrides])
    path = experiment.write_gin(cfg, tmp_path, {})
    with pytest.raises(ConfigError, match=message) as err:
        gin_utils.run_train(path, actions=actions)
    assert "\n" not in str(err.value)


def test_t5x_defaults_and_implemented_values_are_accepted() -> None:
    assert SaveCheckpointConfig(period=2, checkpoint_steps=[3, 5]).checkpoint_steps == [3, 5]
    restore = RestoreCheckpointConfig(path="/x", strict=True, fallback_to_scratch=False,
                                      restore_dataset=False)
    assert restore.paths == ["/x"]
    data = DatasetConfig("task", {"targets": 8}, "train", 2, True, None, use_memory_cache=True)
    assert data.use_memory_cache
    action = Record()
    assert actions.check_actions(None, concurrent_metrics=True) == {}
    assert actions.check_actions({"TRAIN": [action], "INFER_EVAL": []},
                                       concurrent_metrics=False)["TRAIN"] == [action]


def test_restore_latest_starts_from_scratch_without_checkpoints_as_t5x(tmp_path: Path) -> None:
    state, say = object(), Progress(1).message
    assert resume.restore(state, RestoreCheckpointConfig(path=str(tmp_path)), str(tmp_path),
                          say) == (state, 0)
    with pytest.raises(ValueError, match="is not a directory"):
        resume.restore(state, RestoreCheckpointConfig(path=str(tmp_path / "nope")),
                       str(tmp_path), say)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        resume.restore(state, RestoreCheckpointConfig(
            path=str(tmp_path / "weights"), mode="specific"), str(tmp_path), say)


def test_the_progress_line_shows_the_data_wait_share() -> None:
    import io

    from capibara_exp.runtime.metrics import Progress

    out = io.StringIO()
    Progress(100, out).update(40, 2.5, 5800.0, 0.25, data_wait_share=0.031)
    assert out.getvalue() == ("capibara-exp: step 40/100  loss 2.5000  5.8k tok/s  250 ms/step  "
                              "data wait 3.1%  ETA 0:00:15\n")
