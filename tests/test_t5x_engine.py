"""engine=t5x against real T5X: the same config.gin trains there, deterministically for a
seed; a resumed run continues the data stream where it stopped (T5X's dataset checkpoints);
its run dir reads as the local engine's; checkpoints cross between the engines.

T5X is not on PyPI: CI installs it from the sources in ../shared/third_party (.ci/run);
these tests run wherever `t5x` imports.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capibara_exp.launch.t5x_engine import LOCAL_ONLY
from capibara_exp.runtime import checkpoints

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("t5x") is None,
                                 reason="T5X is not installed (not on PyPI; .ci/run installs it)"),
              pytest.mark.slow]

# seqio's own packer under both engines (T5X packs with seqio)
TINY = ["debug=fast", "model.emb_dim=32", "model.mlp_dim=64", "data.batch_size=4",
        "data.packing=seqio", "trainer.eval_period=2", "checkpoint.checkpoint_period=2"]


def capibara(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", *TINY, *args], cwd=cwd,
                         capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Path]:
    """T5X: A, six steps at once; B, four steps, then resumed to six; C, B's first four steps
    resumed to six without T5X's dataset checkpoint; L, the local engine on the same gin."""
    root = tmp_path_factory.mktemp("t5x")
    dirs = {name: root / name for name in ("A", "B", "C", "L")}
    t5x = ["engine=t5x", f"data_dir={data_dir}"]
    capibara(*t5x, "trainer.train_steps=6", f"model_dir={dirs['A']}", cwd=root)
    out = capibara(*t5x, f"model_dir={dirs['B']}", cwd=root)
    dirs["stderr"] = out.stderr
    shutil.copytree(dirs["B"], dirs["C"])
    capibara(*t5x, "trainer.train_steps=6", f"model_dir={dirs['B']}", cwd=root)
    capibara(*t5x, "trainer.train_steps=6", f"model_dir={dirs['C']}",
             "--gin.utils.SaveCheckpointConfig.save_dataset=False", cwd=root)
    capibara(f"data_dir={data_dir}", "trainer.train_steps=6", f"model_dir={dirs['L']}", cwd=root)
    return dirs


def test_t5x_is_deterministic_and_resumes_the_data_stream(runs: dict[str, Path]) -> None:
    a, b, c = (train_losses(runs[k]) for k in "ABC")
    # as the local engine, no train record for an invocation's first (compile) step
    assert sorted(a) == [2, 3, 4, 5, 6] and sorted(b) == sorted(c) == [2, 3, 4, 6]
    # the same seed: the same losses in another process (T5X hands the seed to seqio)
    assert [a[s] for s in range(2, 5)] == [b[s] for s in range(2, 5)]
    # without the dataset checkpoint, the resumed run replays the stream from its start...
    assert c[6] != a[6]
    # ...with it (the default), it continues where it stopped: the uninterrupted run's loss
    assert b[6] == pytest.approx(a[6], rel=1e-6)
    assert list((runs["B"] / "checkpoint_4" / "dataset").glob("train_ds-*"))


def test_t5x_run_dir_reads_as_the_local_engines(runs: dict[str, Path]) -> None:
    t5x, local = runs["A"], runs["L"]
    for run in (t5x, local):
        for name in ("config.gin", "operative_config.gin", ".hydra/config.yaml",
                     "capibara-exp.log", "metrics.jsonl"):
            assert (run / name).is_file(), (run, name)
        assert list((run / "train").glob("events.*")), run
        assert list((run / "train_eval").glob("events.*")), run
        for step in checkpoints.steps(run):
            assert (run / f"checkpoint_{step}" / "capibara_manifest.json").is_file(), (run, step)
    assert not (t5x / "training_eval").exists()
    records = {run: [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
               for run in (t5x, local)}
    for split in ("train", "train_eval"):
        keys = [{k for k in r if k != "time"} for run in (t5x, local)
                for r in records[run] if r["split"] == split]
        core = {"step", "split", "loss", "accuracy", "cross_ent_loss", "z_loss", "perplexity"}
        assert all(core <= k for k in keys), split
    # the same record kinds at the same steps, with the same keys but what T5X cannot measure
    assert [(r["step"], r["split"]) for r in records[t5x]] == \
        [(r["step"], r["split"]) for r in records[local]]
    for ours, theirs in zip(records[local], records[t5x], strict=True):
        measured_here = {k for k in ours if k not in LOCAL_ONLY and not k.startswith("memory/")}
        assert set(theirs) == measured_here, (ours["step"], ours["split"])
        # real target tokens from T5X's rates and seconds: the count the local engine sums
        assert theirs["target_tokens"] == ours["target_tokens"], (ours["step"], ours["split"])
    # the same meaning: untrained, both engines' first loss per token is about ln(vocab)
    for run in (t5x, local):
        first = next(r["loss"] for r in records[run] if r["split"] == "train")
        assert abs(first - math.log(260)) < 1.0, (run, first)
    body = (t5x / "config.gin").read_text().split("# ---- body")[1]
    assert body == (local / "config.gin").read_text().split("# ---- body")[1].replace(
        str(local), str(t5x))


def test_t5x_output_is_quiet_with_progress(runs: dict[str, Path]) -> None:
    stderr = runs["stderr"]
    assert "step 4/4  loss " in stderr and "capibara-exp: done; run dir" in stderr
    # the local engine's line, prefix and data wait (timed around T5X's train iterator)
    steps = [ln for ln in stderr.splitlines() if ln.startswith("capibara-exp: step 4/4  loss ")]
    assert steps and re.search(r"ms/step  data wait \d+\.\d%  ETA", steps[-1]), stderr
    assert all(ln.startswith("capibara-exp: ") for ln in stderr.splitlines() if ln.strip()), \
        stderr
    for noise in ("absl::InitializeLog", "oneDNN", "cuInit", "FunctionDataset", "I0000 "):
        assert noise not in stderr, noise


def test_checkpoints_cross_between_engines(runs: dict[str, Path], data_dir: Path,
                                           tmp_path: Path) -> None:
    """The local engine resumes T5X's checkpoint; T5X resumes the local engine's."""
    run = tmp_path / "X"
    shutil.copytree(runs["B"], run, ignore=shutil.ignore_patterns("checkpoint_6"))
    shutil.rmtree(run / "checkpoint_6", ignore_errors=True)
    out = capibara("engine=local", "trainer.train_steps=6", f"model_dir={run}",
                   f"data_dir={data_dir}", cwd=tmp_path)
    assert f"restored {run}/checkpoint_4" in out.stderr
    out = capibara("engine=t5x", "trainer.train_steps=8", f"model_dir={run}",
                   f"data_dir={data_dir}", cwd=tmp_path)
    assert f"{run}/checkpoint_6 keeps no tf.data iterator (the local engine" in out.stderr
    assert checkpoints.steps(run)[-1] == 8


def codegen_logs(tmp_path: Path, monkeypatch) -> None:
    """The code-generation task's E2B logs (tests/test_infer_eval.py's programs)."""
    from tests.test_infer_eval import PROGRAMS

    logs = tmp_path / "e2b.jsonl"
    logs.write_text("".join(json.dumps({
        "id": f"c{i}", "language": "python", "code": code, "execution": {
            "results": [], "logs": {"stdout": [out], "stderr": []}, "error": None,
            "execution_count": 1}}) + "\n" for i, (code, out) in enumerate(PROGRAMS)))
    monkeypatch.setenv("CAPIBARA_CODEGEN_LOGS", str(logs))


def test_t5x_inference_eval_runs_the_networks_decode_as_capibara_generate(
        tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """Real T5X's inference eval (predict_batch over the project's network and its decode
    cache, seqio.Evaluator, the execution metric) under engine=t5x; its greedy predictions
    are what capibara-exp-generate decodes from the same checkpoint; its pass@1 reaches
    metrics.jsonl as the local engine writes it."""
    from tests.test_infer_eval import INFER

    codegen_logs(tmp_path, monkeypatch)
    run = tmp_path / "run"
    capibara("engine=t5x", f"data_dir={data_dir}", f"model_dir={run}", *INFER, cwd=tmp_path)
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    infer = [r for r in rows if r["split"] == "inference_eval"]
    assert [r["step"] for r in infer] == [2, 4]
    assert all(0 <= r["capibara_e2b_codegen/pass@1"] <= 1 for r in infer)
    logged = [json.loads(r) for r in (run / "inference_eval" /
                                      "capibara_e2b_codegen-000004.jsonl").read_text().splitlines()]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["input"]["inputs_pretokenized"]}) + "\n"
                               for r in logged))
    out = tmp_path / "ours.jsonl"
    subprocess.run([sys.executable, "-m", "capibara_exp.cli.generate", f"checkpoint={run}",
                    f"prompts={prompts}", f"out={out}", "max_new_tokens=12"], check=True,
                   timeout=600)
    ours = [json.loads(r)["outputs"][0]["text"] for r in out.read_text().splitlines()]
    for mine, theirs in zip(ours, logged, strict=True):
        assert len(mine) >= 6 and theirs["prediction"].startswith(mine[:-3])


def test_t5x_inference_eval_draws_several_samples_and_reports_pass_at_k(
        tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """pass@k with k > 1 under real T5X: its InferenceEvaluator's predict_batch draws
    infer_eval_num_samples decodes per example (generation/t5x_models.py), seqio decodes each,
    and the metric's pass@k is the unbiased estimator over the counts it recorded."""
    from tests.test_infer_eval import INFER

    codegen_logs(tmp_path, monkeypatch)
    # the checker (tests.test_infer_eval:odd_output) imports in T5X's child process too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]))
    run = tmp_path / "run"
    capibara("engine=t5x", f"data_dir={data_dir}", f"model_dir={run}", "trainer.train_steps=2",
             *INFER, "infer_eval.infer_eval_num_samples=4", "infer_eval.infer_eval_temperature=1.0",
             "infer_eval.infer_eval_pass_ks=[1,2,3,4]",
             "infer_eval.infer_eval_checker=tests.test_infer_eval:odd_output", cwd=tmp_path)
    predictions = [json.loads(r)["prediction"] for r in (
        run / "inference_eval" / "capibara_e2b_codegen-000002.jsonl").read_text().splitlines()]
    assert len(predictions) == 2 and all(
        isinstance(p, list) and len(p) == 4 for p in predictions), predictions
    assert any(len(set(p)) > 1 for p in predictions), predictions  # sampled, not one decode
    from tests.test_infer_eval import assert_pass_at_k_is_the_estimator

    assert_pass_at_k_is_the_estimator(run)
