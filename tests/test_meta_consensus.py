"""Meta-consensus in one command, on real tiny members: K strategies trained, gated on a
metric read by name from their eval records, the passing ones merged with the strategies'
weights, the merge evaluated like a member, one report; an interrupted command resumes
without training a finished member again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from capibara_exp import experiment
from capibara_exp.base.errors import ConfigError, Preempted
from capibara_exp.cli.meta import compose_member
from capibara_exp.consensus import meta_consensus
from tests.test_train import TINY

COMMON = [*TINY, "trainer.train_steps=4", "trainer.eval_period=4",
          "checkpoint.checkpoint_period=2", "trainer.eval_steps=2"]
STRATEGIES = [{"name": "a", "overrides": ["schedule.base_learning_rate=0.01"], "weight": 1.0},
              {"name": "b", "overrides": ["schedule.base_learning_rate=0.02"], "weight": 3.0},
              {"name": "bad", "overrides": ["schedule.base_learning_rate=1e-7"], "weight": 1.0}]


def meta_cfg(out: Path, **gate) -> OmegaConf:
    return OmegaConf.create({"out": str(out), "meta_consensus": {
        "common": COMMON, "strategies": STRATEGIES,
        "gate": {"metric": "train_eval/loss", "mode": "min", "max_ratio": 1.2,
                 "threshold": None, "min_pass_fraction": 0.5, **gate},
        "merge": {"method": "weighted", "params": {}, "base": None}}})


class Trainer:
    """Trains members as capibara-exp-meta does; preempted at the member named `stop_at`."""

    def __init__(self, stop_at: str | None = None):
        self.stop_at, self.trained = stop_at, []

    def __call__(self, cfg, run_dir: Path, choices: dict) -> None:
        self.trained.append(Path(run_dir).name)
        if Path(run_dir).name == self.stop_at:
            raise Preempted("preempted (test)")
        experiment.run(cfg, run_dir, choices, multirun=True)


def test_meta_consensus_trains_gates_merges_evaluates_and_resumes(tmp_path, data_dir) -> None:
    out = tmp_path / "meta"
    first = Trainer(stop_at="b")
    with pytest.raises(Preempted):
        meta_consensus.run(meta_cfg(out), compose_member, first, print)
    assert first.trained == ["a", "b"]
    a_ckpt = out / "members" / "a" / "checkpoint_4"
    written = a_ckpt.stat().st_mtime_ns
    said = []
    again = Trainer()
    rep = meta_consensus.run(meta_cfg(out), compose_member, again, said.append)
    assert again.trained == ["b", "bad", "merged"]  # a finished: not retrained
    assert "member a finished: not retrained" in said[0] and a_ckpt.stat().st_mtime_ns == written

    rows = {m["name"]: m for m in rep["members"]}
    assert rows["bad"]["passed"] is False and "worse than gate.max_ratio" in \
        rows["bad"]["rejected_because"]
    assert rows["a"]["passed"] and rows["b"]["passed"]
    assert (rows["a"]["merge_weight"], rows["b"]["merge_weight"]) == (0.25, 0.75)
    for name, row in rows.items():  # the gate read each member's own last eval record
        records = [json.loads(x) for x in (out / "members" / name / "metrics.jsonl")
                   .read_text().splitlines()]
        assert row["metric"] == [r for r in records if r["split"] == "train_eval"][-1]["loss"]
    merged = [json.loads(x) for x in (out / "merged" / "metrics.jsonl").read_text().splitlines()]
    assert rep["merged"]["metric"] == merged[-1]["loss"] and merged[-1]["step"] == 4
    assert rep["merged"]["vs_best_member"] == pytest.approx(
        rep["merged"]["metric"] - min(rows["a"]["metric"], rows["b"]["metric"]))
    assert json.loads((out / meta_consensus.REPORT).read_text()) == rep
    assert "merged" in meta_consensus.summary_lines(rep)[-1]


def test_bad_meta_settings_fail_before_anything_trains(tmp_path) -> None:
    trainer = Trainer()
    for gate, message in (({"mode": "lowest"}, "gate.mode must be min or max"),
                          ({"metric": "loss"}, "gate.metric must be <split>/<name>"),
                          ({"metric": "inference_eval/capibara_e2b_codegen/pass@4"},
                           "meta_consensus.gate.metric=inference_eval/capibara_e2b_codegen/pass@4: "
                           "strategy a: "
                           "pass@k comes from the inference eval: add infer_eval=codegen")):
        with pytest.raises(ConfigError, match=message):
            meta_consensus.run(meta_cfg(tmp_path, **gate), compose_member, trainer, print)
    cfg = meta_cfg(tmp_path)
    cfg.meta_consensus.strategies[0].overrides = ["model.emb_dimm=3"]
    with pytest.raises(ConfigError, match=r"strategies \(a\): .*model.emb_dimm"):
        meta_consensus.run(cfg, compose_member, trainer, print)
    cfg = meta_cfg(tmp_path)
    cfg.meta_consensus.merge.method = "slerp"
    with pytest.raises(ConfigError, match="merge: method=slerp merges exactly 2 strategies"):
        meta_consensus.run(cfg, compose_member, trainer, print)
    assert trainer.trained == [] and not (tmp_path / "members").exists()


def test_the_console_script_refuses_a_bad_key_with_exit_2(tmp_path) -> None:
    script = Path(sys.executable).parent / "capibara-exp-meta"
    done = subprocess.run([str(script), f"out={tmp_path}", "meta_consensus.gate.mode=bogus"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "meta_consensus.gate.mode=bogus (set by the command line): expected one of min, " \
        "max" in done.stderr
    assert not (tmp_path / "members").exists()
