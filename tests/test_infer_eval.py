"""Evaluation by generation while training (T5X's infer-eval contract in the local engine)
on the execution-scored E2B code-generation task, and its pass@1 as early-stopping metric,
sweep objective and consensus gate metric."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import seqio

from capibara_exp.consensus import meta_consensus
from capibara_exp.runtime.metrics import final_metrics
from tests.test_train import train

PROGRAMS = [("x = 3\ny = 4\nprint(x * y)\n", "12\n"), ("for i in range(3):\n    print(i)\n",
            "0\n1\n2\n"), ("a = 'ab'\nb = a * 2\nprint(b)\n", "abab\n"),
            ("n = 5\nprint(sum(range(n)))\n", "10\n"), ("s = [3, 1, 2]\ns.sort()\nprint(s)\n",
                                                         "[1, 2, 3]\n")] * 2
INFER = ["infer_eval=codegen", "infer_eval.infer_eval_inputs_length=64",
         "infer_eval.infer_eval_targets_length=16", "infer_eval.infer_eval_batch_size=2"]


@pytest.fixture(autouse=True)
def logs(tmp_path: Path, monkeypatch) -> Path:
    """E2B-format logs of executed cells (the SDK's nested shape)."""
    path = tmp_path / "e2b.jsonl"
    rows = [{"id": f"c{i}", "language": "python", "code": code, "execution": {
        "results": [], "logs": {"stdout": [out], "stderr": []}, "error": None,
        "execution_count": 1}} for i, (code, out) in enumerate(PROGRAMS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("CAPIBARA_CODEGEN_LOGS", str(path))
    return path


def evaluate_with(predict, vocabulary=None) -> dict:
    """seqio.Evaluator on the task's validation split (in `vocabulary`, the byte one by
    default) with a given predict_fn."""
    from capibara_exp.generation import codegen_task

    task = seqio.get_mixture_or_task(codegen_task.configured(vocabulary=vocabulary))
    evaluator = seqio.Evaluator(codegen_task.TASK, seqio.DecoderFeatureConverter(pack=False),
                                eval_split="validation",
                                sequence_length={"inputs": 64, "targets": 32})
    vocab = task.output_features["targets"].vocabulary
    metrics, _ = evaluator.evaluate(compute_metrics=True, step=0, predict_fn=lambda ds: [
        (i, vocab.encode(predict(ex))) for i, ex in ds.as_numpy_iterator()])
    return metrics.result()[codegen_task.TASK]


def test_the_task_scores_the_logged_programs_by_running_them() -> None:
    from capibara_exp.generation import codegen_task

    rows = codegen_task.examples(Path(codegen_task.logs_path()))
    rest = {r["prompt"]: r["rest"] for r in rows}
    vocab = seqio.ByteVocabulary()
    oracle = evaluate_with(lambda ex: rest[vocab.decode(
        [int(t) for t in ex["decoder_input_tokens"] * ex["decoder_causal_attention"] if t > 1])])
    assert oracle["pass@1"] == 1.0
    wrong = evaluate_with(lambda ex: "print('nope')\n")
    assert wrong["pass@1"] == 0.0


def test_training_runs_the_inference_eval_and_early_stopping_reads_it(tmp_path: Path,
                                                                       data_dir) -> None:
    run = tmp_path / "run"
    train(run, "trainer.train_steps=4", "trainer.eval_period=2",
          "checkpoint.checkpoint_period=2", *INFER)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    infer = [r for r in rows if r["split"] == "inference_eval"]
    assert [r["step"] for r in infer] == [2, 4]
    key = "capibara_e2b_codegen/pass@1"
    assert all(0.0 <= r[key] <= 1.0 and r[key + "_low"] <= r[key] <= r[key + "_high"]
               for r in infer)
    assert (run / "inference_eval" / "capibara_e2b_codegen").is_dir()  # seqio's TensorBoard
    assert (run / "inference_eval" / "capibara_e2b_codegen-metrics.jsonl").is_file()
    assert final_metrics(run)[key] == infer[-1][key]  # what a sweep trial returns
    assert meta_consensus.metric_of(run, f"inference_eval/{key}") == infer[-1][key]

    stopped = tmp_path / "stopped"
    train(stopped, "trainer.train_steps=8", "trainer.eval_period=2", *INFER,
          "early_stopping=pass_at_k", "early_stopping.early_stopping_patience=1",
          "early_stopping.early_stopping_atol=2.0")  # no gain can beat 2.0: stop at once
    rows = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) < 8


def odd_output(outcome, expected) -> bool:
    """A user checker (infer_eval_checker): passes a program whose output (stdout and stderr)
    has an odd length, so samples of one problem pass and fail by what they print."""
    return len(outcome.stdout + outcome.stderr) % 2 == 1


def assert_pass_at_k_is_the_estimator(run: Path) -> None:
    """A run's inference eval (2 problems, 4 samples each, pass_ks [1..4]) reports pass@k
    equal to the unbiased estimator over the per-problem counts it recorded."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (got,) = [r for r in rows if r["split"] == "inference_eval"]
    # the counts seqio's JSON logger recorded for the step: [samples, passed] per problem
    logged = [json.loads(line) for line in (run / "inference_eval" /
              "capibara_e2b_codegen-metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in logged if r["step"] == got["step"]]
    counts = json.loads(record["pass_counts"])
    assert len(counts) == 2 and all(n == 4 for n, _ in counts)  # 2 validation problems
    assert any(0 < c < n for n, c in counts), f"{counts}: pass@k could not tell k apart"
    for k in (1, 2, 3, 4):
        want = sum(1 - math.comb(n - c, k) / math.comb(n, k) for n, c in counts) / len(counts)
        assert math.isclose(got[f"capibara_e2b_codegen/pass@{k}"], want, rel_tol=1e-12,
                            abs_tol=1e-12), (k, counts)
        assert math.isclose(record[f"pass@{k}"], want, rel_tol=1e-12, abs_tol=1e-12)
    assert "capibara_e2b_codegen/pass@5" not in got


def test_pass_at_k_of_several_samples_is_the_estimator_over_the_recorded_counts(
        tmp_path: Path, data_dir) -> None:
    run = tmp_path / "run"
    train(run, "trainer.train_steps=2", "trainer.eval_period=2",
          "checkpoint.checkpoint_period=2", *INFER, "infer_eval.infer_eval_num_samples=4",
          "infer_eval.infer_eval_temperature=1.0", "infer_eval.infer_eval_pass_ks=[1,2,3,4]",
          "infer_eval.infer_eval_checker=tests.test_infer_eval:odd_output")
    assert_pass_at_k_is_the_estimator(run)


@pytest.mark.parametrize("overrides, message", [
    (["infer_eval.infer_eval_pass_ks=[1,5]", "infer_eval.infer_eval_num_samples=4",
      "infer_eval.infer_eval_temperature=1.0"],
     "infer_eval.infer_eval_pass_ks=[1, 5] (set by the command line): pass@5 needs at least 5 "
     "samples per example (infer_eval.infer_eval_num_samples=4)"),
    (["infer_eval.infer_eval_num_samples=4"], "infer_eval.infer_eval_num_samples=4 (set by the "
     "command line): more than one sample needs infer_eval.infer_eval_temperature > 0"),
    (["infer_eval.infer_eval_num_samples=2", "infer_eval.infer_eval_temperature=0.7",
      "lora=attention", "lora.base_checkpoint=x"], "infer_eval.infer_eval_num_samples=2 (set "
     "by the command line): a LoRA run has no inference eval"),
    (["lora=attention", "lora.base_checkpoint=x"], "infer_eval.infer_eval_num_samples=1 ("),
    (["early_stopping=pass_at_k", "early_stopping.early_stopping_metric=pass@4"],
     "early_stopping.early_stopping_metric=pass@4 (set by the command line): pass@4 is not "
     "reported (infer_eval.infer_eval_pass_ks=[1])"),
    (["infer_eval.infer_eval_checker=no_such_module_here:check"],
     "infer_eval.infer_eval_checker=no_such_module_here:check (set by the command line): no "
     "module 'no_such_module_here' on this Python's path"),
    (["infer_eval.infer_eval_checker=tests.test_infer_eval"],
     "infer_eval.infer_eval_checker=tests.test_infer_eval (set by the command line): must be "
     "'module:function'"),
])
def test_sample_settings_are_refused_at_compose_time(overrides, message) -> None:
    """...and several samples are not refused under engine=t5x (T5X draws them:
    tests/test_t5x_engine.py)."""
    from capibara_exp.base.errors import ConfigError
    from capibara_exp.cli import checks, flags
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    line = flags.parse(["infer_eval=codegen", *overrides, "model_dir=/tmp/x"])
    with pytest.raises(ConfigError) as err:
        checks.compose_checked(line, "config")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_several_samples_compose_under_engine_t5x() -> None:
    from capibara_exp.cli import checks, flags
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    line = flags.parse(["infer_eval=codegen", "infer_eval.infer_eval_num_samples=2",
                        "infer_eval.infer_eval_temperature=0.7", "engine=t5x",
                        "infer_eval.infer_eval_pass_ks=[1,2]", "model_dir=/tmp/x"])
    cfg = checks.compose_checked(line, "config")[0]
    assert cfg.cfg.infer_eval.infer_eval_num_samples == 2 and cfg.cfg.engine.name == "t5x"


def test_the_task_and_the_inference_eval_take_the_models_vocabulary(tmp_path: Path,
                                                                   data_dir) -> None:
    """A tokenizer.json vocabulary (a BPE trained here): the task tokenizes in it, scores
    what is decoded from it, and a run's inference eval reads it."""
    from capibara_exp.data import vocabularies
    from capibara_exp.generation import codegen_task
    from tests import hf_reference

    path = hf_reference.build_tokenizer(tmp_path / "tok") / "tokenizer.json"
    vocab = vocabularies.get("tokenizer_json", str(path))
    assert codegen_task.configured(vocabulary=vocab) == codegen_task.TASK
    task = seqio.get_mixture_or_task(codegen_task.TASK)
    assert task.output_features["targets"].vocabulary == vocab
    rows = codegen_task.examples(Path(codegen_task.logs_path()))
    rest = {r["prompt"]: r["rest"] for r in rows}
    oracle = evaluate_with(lambda ex: rest[vocab.decode(
        [int(t) for t in ex["decoder_input_tokens"] * ex["decoder_causal_attention"] if t])],
        vocab)
    assert oracle["pass@1"] == 1.0

    run = tmp_path / "run"
    train(run, "trainer.train_steps=2", "trainer.eval_period=2",
          "checkpoint.checkpoint_period=2", "model.vocabulary=tokenizer_json",
          f"model.vocabulary_path={path}", f"model.vocab_size={vocab.vocab_size}", *INFER)
    logged = [json.loads(line) for line in (run / "inference_eval" /
              "capibara_e2b_codegen-000002.jsonl").read_text().splitlines()]
    assert len(logged) == 2
    for row in logged:
        assert row["input"]["inputs"] == list(vocab.encode(row["input"]["inputs_pretokenized"]))
    (infer,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["split"] == "inference_eval"]
    assert 0.0 <= infer["capibara_e2b_codegen/pass@1"] <= 1.0


def test_a_sweep_on_a_pass_at_k_the_runs_do_not_report_is_refused() -> None:
    from capibara_exp.base.errors import ConfigError
    from capibara_exp.cli import checks, flags
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    samples = ["infer_eval=codegen", "infer_eval.infer_eval_num_samples=4",
               "infer_eval.infer_eval_temperature=0.8", "+sweeps=pass_at_k",
               "hydra.sweeper.metric=capibara_e2b_codegen/pass@4"]
    line = flags.parse(["-m", *samples, "infer_eval.infer_eval_pass_ks=[1,4]"])
    checks.check_sweep(checks.compose_checked(line, "config")[0])  # reported: accepted
    line = flags.parse(["-m", *samples])
    with pytest.raises(ConfigError) as err:
        checks.check_sweep(checks.compose_checked(line, "config")[0])
    assert str(err.value) == ("hydra.sweeper.metric=capibara_e2b_codegen/pass@4: pass@4 is not "
                              "reported (infer_eval.infer_eval_pass_ks=[1])")
