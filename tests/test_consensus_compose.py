"""Merges that compose with training features, on real tiny runs: EMA runs merge their EMA
weights (or the raw ones), fine-tunes of one base record their lineage and soup, while
runs from different initialisations are refused a soup (lineage, or distance where none
is recorded) but take a robust merge."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from capibara_exp.composing.merge_methods import MergeSpec
from capibara_exp.consensus import ancestry, store
from capibara_exp.consensus.gate import GateConfig
from capibara_exp.consensus.merge import merge
from capibara_exp.runtime import integrity, lineage
from tests.test_train import read_checkpoint, train

STEPS = ["trainer.train_steps=3", "trainer.eval_period=3", "checkpoint.checkpoint_period=3"]
NO_LOSS = GateConfig(max_val_loss_ratio=None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> dict:
    """From scratch: seed 0 with EMA, seed 0 plain, seed 1 plain; and two fine-tunes of the
    first plain run with other seeds and learning rates."""
    root = tmp_path_factory.mktemp("compose")
    train(root / "ema", *STEPS, "ema=default", "ema.ema_decay=0.5", "random_seed=0")
    train(root / "plain", *STEPS, "random_seed=0", "schedule.base_learning_rate=0.02")
    train(root / "seed1", *STEPS, "random_seed=1")
    base = root / "plain" / "checkpoint_3"
    for name, seed in (("ft_a", 5), ("ft_b", 6)):
        train(root / name, "trainer.train_steps=6", "trainer.eval_period=3",
              "checkpoint.checkpoint_period=3", f"random_seed={seed}",
              f"gin_bindings=[\"utils.RestoreCheckpointConfig.path = '{base}'\", "
              "\"utils.RestoreCheckpointConfig.mode = 'specific'\"]")
    return {"root": root}


def cand(runs: dict, name: str, **kw) -> store.Candidate:
    return store.candidate_from_path(runs["root"] / name, name=name, **kw)


def test_an_ema_run_merges_its_ema_weights_in_a_robust_median(runs, tmp_path) -> None:
    pool = [cand(runs, n) for n in ("ema", "plain", "seed1")]
    # seed1 sits far from the other two (another init): the distance gate is off here.
    gate = GateConfig(max_val_loss_ratio=None, max_distance_ratio=None)
    rep = merge(pool, MergeSpec("median"), tmp_path / "m", gate_cfg=gate)
    assert [r["params"] for r in rep["candidates"]] == ["ema_target", "target", "target"]
    assert all(r["accepted"] for r in rep["candidates"])
    trees = [read_checkpoint(runs["root"] / n, 3) for n in ("ema", "plain", "seed1")]
    ema_params = trees[0]["ema_target"]
    assert not np.array_equal(jax.tree.leaves(ema_params)[0], jax.tree.leaves(
        trees[0]["target"])[0])  # EMA and raw weights differ: which one is merged matters
    merged = read_checkpoint(tmp_path / "m", 3)
    assert "ema_target" not in merged  # the plain runs have no EMA to resume
    want = np.median(np.stack([np.asarray(jax.tree.leaves(t)[0]) for t in
                               (ema_params, trees[1]["target"], trees[2]["target"])]), axis=0)
    np.testing.assert_allclose(np.asarray(jax.tree.leaves(merged["target"])[0]), want,
                               rtol=1e-6)
    raw = merge([cand(runs, n, use_ema=False) for n in ("ema", "plain", "seed1")],
                MergeSpec("median"), tmp_path / "raw", gate_cfg=gate)
    assert [r["params"] for r in raw["candidates"]][0] == "target"


def test_merged_ema_runs_keep_an_ema_copy_an_ema_run_resumes_from(runs, tmp_path) -> None:
    shutil.copytree(runs["root"] / "ema", tmp_path / "ema2")
    pool = [cand(runs, "ema"), store.candidate_from_path(tmp_path / "ema2", name="ema2")]
    merge(pool, MergeSpec("uniform"), tmp_path / "m", gate_cfg=NO_LOSS)
    merged = read_checkpoint(tmp_path / "m", 3)
    for a, b in zip(jax.tree.leaves(merged["ema_target"]), jax.tree.leaves(merged["target"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    step, _ = train(tmp_path / "resumed", "trainer.train_steps=4", "trainer.eval_period=4",
                    "checkpoint.checkpoint_period=4", "ema=default",
                    f"gin_bindings=[\"utils.RestoreCheckpointConfig.path = "
                    f"'{tmp_path / 'm' / 'checkpoint_3'}'\", "
                    "\"utils.RestoreCheckpointConfig.mode = 'specific'\"]")
    assert step == 4


def test_runs_record_their_lineage_in_every_manifest(runs) -> None:
    root = runs["root"]
    plain, seed1 = (lineage.of_checkpoint(root / n / "checkpoint_3") for n in ("plain", "seed1"))
    assert len(plain) == 1 and plain[0]["id"].startswith("init:")
    assert "seed 0" in plain[0]["from"] and plain != seed1
    assert lineage.of_checkpoint(root / "ema" / "checkpoint_3") == plain  # one init, EMA or not
    ft = lineage.of_checkpoint(root / "ft_a" / "checkpoint_6")
    assert ft[0]["from"] == f"checkpoint {root / 'plain' / 'checkpoint_3'}"
    assert ft[0]["id"] == "ckpt:" + integrity.read_manifest(root / "plain" / "checkpoint_3")[
        "checksum"][:16]
    assert ft[1:] == plain


def test_a_soup_of_unrelated_runs_is_refused_with_the_reason(runs, tmp_path) -> None:
    with pytest.raises(ancestry.UnrelatedCandidates,
                       match=r"method=uniform: the candidates share no ancestor \(plain from "
                             r"initialisation with seed 0; seed1 from initialisation with seed 1\)"
                             r": a soup averages fine-tunes of one model"):
        merge([cand(runs, "plain"), cand(runs, "seed1")], MergeSpec("uniform"), tmp_path / "u",
              gate_cfg=NO_LOSS)
    assert not (tmp_path / "u").exists()  # refused: nothing written
    soup = merge([cand(runs, "ft_a"), cand(runs, "ft_b")], MergeSpec("uniform"), tmp_path / "ft",
                 gate_cfg=NO_LOSS)  # fine-tunes of one base, other seeds: a soup
    assert lineage.of_checkpoint(Path(soup["merged_checkpoint"])) == lineage.of_checkpoint(
        runs["root"] / "ft_a" / "checkpoint_6")
    merge([cand(runs, "plain"), cand(runs, "seed1")], MergeSpec("uniform"), tmp_path / "forced",
          gate_cfg=GateConfig(max_val_loss_ratio=None, require_shared_ancestor=False))


def _without_lineage(src: Path, dst: Path) -> store.Candidate:
    """A copy whose manifest records no lineage (as T5X's checkpoints, given one by the
    checksum action)."""
    shutil.copytree(src, dst)
    step_dir = dst / "checkpoint_3"
    (step_dir / integrity.MANIFEST).unlink()
    integrity.write_manifest(step_dir, step=3, kind="action")
    return store.candidate_from_path(dst, name=dst.name)


def test_without_lineage_the_weights_distance_decides(runs, tmp_path) -> None:
    plain = _without_lineage(runs["root"] / "plain", tmp_path / "plain")
    ema = cand(runs, "ema")  # recorded lineage; plain's copy has none: distance decides
    rep = merge([plain, ema], MergeSpec("uniform"), tmp_path / "ok", gate_cfg=NO_LOSS)
    assert rep["relative_distance"]["plain"] < 0.2
    seed1 = _without_lineage(runs["root"] / "seed1", tmp_path / "seed1")
    with pytest.raises(ancestry.UnrelatedCandidates,
                       match=r"plain and seed1 do not look like fine-tunes of one model: their "
                             r"parameters are 1\.[0-9]+ apart relative to their size"):
        merge([plain, seed1], MergeSpec("uniform"), tmp_path / "no", gate_cfg=NO_LOSS)
    assert not (tmp_path / "no").exists()
