"""Staged curriculum: stages in order within one run, and a resume mid-stage that ends with
the parameters of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import seqio
import tensorflow as tf

from capibara_exp import experiment
from capibara_exp.data import corpus, tasks
from capibara_exp.runtime import checkpoints, gin_utils
from capibara_exp.runtime.curriculum import Stage, parse_stages, stage_at
from capibara_exp.runtime.trainer import BaseAction
from tests.conftest import compose_config
from tests.test_train import TINY, leaves_equal, read_checkpoint

UPPER = "capibara_test_bytes_lm_upper"


def _upper_lines(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del shuffle_files, seed
    corpus.manifest(tasks.data_dir())  # a task only reads: NotBuilt when nothing is built
    path = corpus.corpus_dir(tasks.data_dir()) / f"{split}.txt"
    return tf.data.TextLineDataset(str(path)).map(lambda line: {"targets": tf.strings.upper(line)})


if UPPER not in seqio.TaskRegistry.names():  # a second task: the same corpus in capitals
    seqio.TaskRegistry.add(
        UPPER, source=seqio.FunctionDataSource(_upper_lines, splits=("train", "validation")),
        preprocessors=[seqio.preprocessors.tokenize, tasks.split_to_length,
                       seqio.preprocessors.append_eos_after_trim],
        output_features=tasks.LM_OUTPUT_FEATURES, metric_fns=[])

STAGES = (f"curriculum.curriculum_stages=[{{mixture_or_task_name: {tasks.BYTES_LM}, steps: 2}}, "
          f"{{mixture_or_task_name: {UPPER}, steps: 3, module: tests.test_curriculum}}]")
COMMON = ["curriculum=staged", STAGES, "trainer.train_steps=5", "trainer.eval_period=5",
          "checkpoint.checkpoint_period=1", "checkpoint.checkpoints_to_keep=null"]


class StopAt(BaseAction):
    """Stops training at a step, as a preempted job would (its checkpoint is written)."""

    def __init__(self, step: int):
        self.step = step

    def run(self, train_state, metrics_by_task) -> bool:
        return int(train_state.step) >= self.step


def run(model_dir: Path, *overrides: str, actions: dict | None = None):
    cfg = compose_config([f"model_dir={model_dir}", *TINY, *overrides])
    path = experiment.write_gin(cfg, model_dir, {}, lambda: experiment.prepare_data(cfg))
    return gin_utils.run_train(path, actions=actions)


def test_stages_are_checked_and_located() -> None:
    stages = parse_stages([{"mixture_or_task_name": "a", "steps": 3},
                           {"mixture_or_task_name": "b", "steps": 4, "module": "m"}], 7)
    assert stages == [Stage("a", 3), Stage("b", 4, "m")]
    assert [stage_at(stages, s) for s in (0, 2, 3, 5, 6)] == [
        (0, 0), (0, 2), (1, 0), (1, 2), (1, 3)]
    with pytest.raises(ValueError, match=r"add up to 7 \(3 \+ 4\), but train_script.train."
                                         r"total_steps=8"):
        parse_stages([{"mixture_or_task_name": "a", "steps": 3},
                      {"mixture_or_task_name": "b", "steps": 4}], 8)
    with pytest.raises(ValueError, match=r"curriculum\[0\].*unknown: \['task'\]"):
        parse_stages([{"task": "a", "steps": 3}], 3)


@pytest.mark.slow
def test_resume_mid_stage_two_ends_with_the_uninterrupted_parameters(tmp_path: Path,
                                                                     corpus_data) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run(straight, *COMMON)[0] == 5
    assert run(stopped, *COMMON, actions={"TRAIN_EVAL": [StopAt(4)]})[0] == 4  # mid-stage 2
    final, at_4 = read_checkpoint(straight, 5), read_checkpoint(stopped, 4)
    assert not leaves_equal(at_4["target"], final["target"])  # resuming has work to do
    assert leaves_equal(at_4, read_checkpoint(straight, 4))
    assert run(stopped, *COMMON)[0] == 5
    assert checkpoints.steps(stopped)[-1] == 5
    assert leaves_equal(read_checkpoint(stopped, 5), final)

    # Stage 2 reads its own task: with the first task in both stages, step 2 is the same
    # and step 3 (the first batch of stage 2) is not.
    one_task = tmp_path / "one_task"
    run(one_task, *[c.replace(UPPER, tasks.BYTES_LM) for c in COMMON],
        actions={"TRAIN_EVAL": [StopAt(3)]})
    assert leaves_equal(read_checkpoint(one_task, 2), read_checkpoint(straight, 2))
    assert not leaves_equal(read_checkpoint(one_task, 3)["target"],
                            read_checkpoint(straight, 3)["target"])


SETTINGS = (
    "curriculum.curriculum_stages=["
    f"{{mixture_or_task_name: {tasks.BYTES_LM}, steps: 2, learning_rate: 0.02, "
    "frozen: ['token_embedder/.*']}, "
    f"{{mixture_or_task_name: {UPPER}, steps: 3, module: tests.test_curriculum, batch_size: 2, "
    "learning_rate: 0.005, schedule: {warmup_steps: 2, restart: true}}]")
WITH_SETTINGS = ["curriculum=staged", SETTINGS, "trainer.train_steps=5", "trainer.eval_period=5",
                 "checkpoint.checkpoint_period=1", "checkpoint.checkpoints_to_keep=null",
                 "schedule.warmup_steps=2"]


def _records(model_dir: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["split"] == "train"]


@pytest.mark.slow
def test_stages_have_their_own_learning_rate_batch_size_and_frozen_modules(
        tmp_path: Path, corpus_data) -> None:
    from capibara_exp.runtime.utils import create_learning_rate_scheduler

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run(straight, *WITH_SETTINGS)[0] == 5
    emb = [read_checkpoint(straight, s)["target"]["token_embedder"] for s in (1, 2, 3)]
    assert leaves_equal(emb[0], emb[1])  # frozen in stage 1
    assert not leaves_equal(emb[1], emb[2])  # trains in stage 2
    rest = [{k: v for k, v in read_checkpoint(straight, s)["target"].items()
             if k != "token_embedder"} for s in (1, 2)]
    assert not leaves_equal(*rest)  # the rest trains in stage 1
    schedule = create_learning_rate_scheduler(  # conf/schedule/warmup_rsqrt.yaml's factors
        factors="constant * linear_warmup * rsqrt_normalized_decay", base_learning_rate=1.0,
        warmup_steps=2)
    want = [float(schedule.at(0, base_learning_rate=0.02)),
            float(schedule.at(1, base_learning_rate=0.02)),
            float(schedule.at(2, base_learning_rate=0.005, step_offset=2.0)),
            float(schedule.at(3, base_learning_rate=0.005, step_offset=2.0)),
            float(schedule.at(4, base_learning_rate=0.005, step_offset=2.0))]
    assert [r["learning_rate"] for r in _records(straight)] == pytest.approx(want[1:], rel=1e-6)
    # Stage 2's batches have 2 rows (its batch size), stage 1's the run's 4.
    tokens = [r["target_tokens"] for r in _records(straight)]
    assert max(tokens[2:]) <= 2 * 64 < min(tokens[:1])

    assert run(stopped, *WITH_SETTINGS, actions={"TRAIN_EVAL": [StopAt(3)]})[0] == 3
    assert run(stopped, *WITH_SETTINGS)[0] == 5  # resumed mid-stage 2, with its settings
    assert leaves_equal(read_checkpoint(stopped, 5), read_checkpoint(straight, 5))


def test_stage_settings_are_checked() -> None:
    for stage, message in (
            ({"steps": 2, "batch_size": 0}, r"\[0\].batch_size must be an integer >= 1"),
            ({"steps": 2, "learning_rate": -1.0}, r"\[0\].learning_rate must be a finite"),
            ({"steps": 2, "schedule": {"warmup": 3}}, r"\[0\].schedule: warmup=3 is not one"),
            ({"steps": 2, "mixture_rates": {"a": 0}}, r"\[0\].mixture_rates must map"),
            ({"steps": 2, "frozen": ["("]}, r"\[0\].frozen: '\(' is not a regular")):
        with pytest.raises(ValueError, match=message):
            parse_stages([stage], 2)


def test_easy_to_hard_stages_read_the_routing_data_by_difficulty(e2b_data) -> None:
    import dataclasses

    from capibara_exp.data import routing_difficulty
    from capibara_exp.runtime import curriculum
    from capibara_exp.runtime.utils import DatasetConfig

    cfg = DatasetConfig(mixture_or_task_name="capibara_bytes_lm", task_feature_lengths={
        "targets": 64}, split="train", batch_size=4, shuffle=False, seed=0)
    stage = curriculum.Stage(routing_difficulty.MIXTURE, 2,
                             module="capibara_exp.data.routing_difficulty",
                             mixture_rates={"easy": 1.0, "medium": 1.0})
    got = curriculum.stage_dataset(stage, cfg)
    mixture = seqio.get_mixture_or_task(got.mixture_or_task_name)
    assert sorted(t.name for t in mixture.tasks) == [
        routing_difficulty.difficulty_task("easy"), routing_difficulty.difficulty_task("medium")]
    for difficulty in ("easy", "hard"):
        task = seqio.get_mixture_or_task(routing_difficulty.difficulty_task(difficulty))
        seen = {ex["difficulty"].decode() for ex in task.get_dataset(
            {"targets": 64}, split="train", shuffle=False).take(20).as_numpy_iterator()}
        assert seen == {difficulty}
    with pytest.raises(ValueError, match="mixture_rates key 'expert' names no task"):
        curriculum.stage_dataset(dataclasses.replace(stage, mixture_rates={"expert": 1.0}), cfg)
