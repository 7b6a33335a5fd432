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
    corpus.build_corpus(tasks.data_dir())
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
    return gin_utils.run_train(experiment.write_gin(cfg, model_dir, {}), actions=actions)


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
                                                                     data_dir) -> None:
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
