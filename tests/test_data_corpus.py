"""The text corpus (data/corpus.py) has the E2B data's one trigger: a run's data preparation
(experiment.prepare_data, before JAX starts) or `capibara-exp-data` builds it, and its task
(capibara_bytes_lm) only reads, failing with one line that names the command to run."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from capibara_exp import experiment
from capibara_exp.data import corpus
from capibara_exp.data.e2b import built
from tests.conftest import compose_config
from tests.test_train import TINY

DATA_CLI = [sys.executable, "-m", "capibara_exp.cli.data"]


def first_example(split: str = "validation") -> dict:
    import seqio

    from capibara_exp.data import tasks

    return next(seqio.get_mixture_or_task(tasks.BYTES_LM).get_dataset(
        {"targets": 64}, split=split, shuffle=False, num_epochs=1,
        use_cached=False).as_numpy_iterator())


def command_in(message: str) -> list[str]:
    """The command a NotBuilt line names (between backquotes), as argv."""
    found = re.search(r"`([^`]+)`", message)
    assert found, message
    return shlex.split(found.group(1))


def test_the_corpus_task_never_builds_and_its_line_names_the_command_that_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(data))
    with pytest.raises(built.NotBuilt) as caught:
        first_example()
    message = str(caught.value)
    assert "\n" not in message and "no text corpus built under" in message
    assert f"capibara-exp-data data_dir={data} 'datasets=[bytes_lm]'" in message
    assert list(data.iterdir()) == []  # nothing built, nothing made
    # the command it names builds the corpus (and only it); then the task reads
    argv = command_in(message)
    assert argv[0] == "capibara-exp-data"
    done = subprocess.run([*DATA_CLI, *argv[1:]], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in data.iterdir()) == [corpus.CORPUS_NAME]
    lines = (corpus.corpus_dir(data) / "validation.txt").read_text().splitlines()
    assert len(first_example()["targets"]) > 0
    assert corpus.manifest(data)["splits"]["validation"]["lines"] == len(lines)


def test_which_builds_a_run_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(built.CODEGEN_LOGS_ENV, raising=False)
    builds = {o: experiment.data_builds(compose_config(o.split())) for o in (
        "", "data=e2b_routing", "data=e2b_routing curriculum=easy_to_hard", "infer_eval=codegen",
        "data=e2b_routing curriculum=staged "
        "curriculum.curriculum_stages=[{mixture_or_task_name:capibara_bytes_lm,steps:2}]")}
    assert builds == {
        "": ["bytes_lm"], "data=e2b_routing": ["e2b_routing"],
        "data=e2b_routing curriculum=easy_to_hard": ["e2b_routing"],
        "infer_eval=codegen": ["bytes_lm", "e2b_routing"],
        "data=e2b_routing curriculum=staged curriculum.curriculum_stages="
        "[{mixture_or_task_name:capibara_bytes_lm,steps:2}]": ["bytes_lm", "e2b_routing"]}
    # the task in another vocabulary (lm_task's variant names) reads the corpus too
    assert corpus.reads_corpus("capibara_bytes_lm_sp8000")
    assert not corpus.reads_corpus("capibara_bytes_lmx") and not corpus.reads_corpus(None)


# A run's data preparation in a process of its own: what it imported is printed after it.
PREPARE = """
import sys
from hydra import compose, initialize_config_dir
from capibara_exp import experiment
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli.common import register_resolvers
register_resolvers()
with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[1:])
experiment.prepare_data(cfg)
print(sorted(m for m in ("jax", "tensorflow", "seqio", "flax") if m in sys.modules))
"""


def test_prepare_data_builds_the_corpus_a_run_reads_before_jax_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "CAPIBARA_DATA_DIR"}
    done = subprocess.run([sys.executable, "-c", PREPARE, "data=bytes_lm", f"data_dir={data}",
                           f"model_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"  # built with no JAX, TF or SeqIO
    assert sorted(p.name for p in data.iterdir()) == [corpus.CORPUS_NAME]  # not the E2B data
    assert corpus.manifest(data)["splits"]["train"]["lines"] > 0
    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(data))
    assert len(first_example("train")["targets"]) > 0


@pytest.mark.slow
def test_a_run_on_an_empty_data_dir_builds_the_corpus_and_trains(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "CAPIBARA_DATA_DIR"}
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", "debug=fast", *TINY,
                          "trainer.train_steps=2", f"data_dir={data}", f"model_dir={run}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"capibara-exp: done; run dir {run}"
    assert sorted(p.name for p in data.iterdir()) == [corpus.CORPUS_NAME]
    assert corpus.manifest(data)["files_read"] > 0 and (run / "metrics.jsonl").is_file()


def _rendered(tmp_path: Path, *overrides: str) -> Path:
    """config.gin for a tiny run, written without preparing its data."""
    cfg = compose_config([f"model_dir={tmp_path / 'run'}", *TINY, "trainer.train_steps=2",
                          *overrides])
    return experiment.write_gin(cfg, tmp_path / "run", {})


NO_T5X = pytest.mark.skipif(importlib.util.find_spec("t5x") is None,
                            reason="T5X is not installed (not on PyPI; .ci/run installs it)")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", pytest.param("t5x", marks=NO_T5X)])
def test_training_a_rendered_gin_with_no_corpus_is_one_line_exit_2(engine: str,
                                                                    tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    gin = _rendered(tmp_path, f"engine={engine}", "data.packing=seqio")
    module, prog = {"local": (["capibara_exp.runtime", str(gin)], "capibara_exp.runtime"),
                    "t5x": (["capibara_exp.launch.t5x_main", f"--gin_file={gin}"],
                            "capibara_exp.launch.t5x_main")}[engine]
    out = subprocess.run([sys.executable, "-m", *module], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "CAPIBARA_DATA_DIR": str(data)},
                         check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: configuration error: ") and "no text corpus" in last, \
        out.stderr[-3000:]
    assert f"`capibara-exp-data data_dir={data} 'datasets=[bytes_lm]'`" in last
    assert list(data.iterdir()) == []
