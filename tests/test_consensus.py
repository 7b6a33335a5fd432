"""Consensus merging on real tiny candidates: trained a few steps from one init on
different batches of the task, saved as T5X-layout checkpoints with manifests."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from capibara_exp import experiment
from capibara_exp.base.errors import ConfigError
from capibara_exp.consensus import action, federated, merge_report, methods, run, store, validation
from capibara_exp.consensus.gate import ConsensusError, GateConfig, run_gate
from capibara_exp.consensus.merge import REPORT, MergeSpec, merge
from capibara_exp.runtime import checkpoints, integrity
from capibara_exp.runtime.trainer import TrainState
from tests.conftest import compose_config

TINY = ["model.emb_dim=32", "model.num_heads=2", "model.head_dim=16", "model.mlp_dim=64",
        "data.batch_size=4", "data.task_feature_lengths={targets: 64}", "trainer.eval_steps=2",
        "schedule.warmup_steps=2"]
NUM_HONEST, LOCAL_STEPS = 5, 4
OFF = GateConfig(check_finite=False, max_val_loss_ratio=None, max_distance_ratio=None,
                 min_pass_fraction=0.0, require_shared_ancestor=False)


def read_tree(step_dir: Path) -> dict:
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(step_dir / "state")


def save_tree(model_dir: Path, step: int, tree: dict, config_gin: Path) -> store.Candidate:
    mgr = checkpoints.manager(model_dir)
    checkpoints.save(mgr, step, tree)
    mgr.close()
    shutil.copy(config_gin, model_dir / run.CONFIG_GIN)
    return store.candidate_from_path(model_dir, name=model_dir.name)


@pytest.fixture(scope="session")
def setup(tmp_path_factory, data_dir):
    """Honest candidates from one init (different batches), the base, an evaluator."""
    root = tmp_path_factory.mktemp("consensus")
    cfg = compose_config([f"model_dir={root / 'run'}", *TINY])
    config_gin = experiment.write_gin(cfg, root / "run", {})
    parts = run.load_parts(config_gin)
    trainer, state0 = federated.build_trainer(parts, seed=0)
    base = save_tree(root / "base", 0, jax.device_get(state0.state_dict()), config_gin)
    honest = []
    batches = federated.client_batches(parts, 0, 1)  # one pipeline: consecutive, disjoint batches
    for i in range(NUM_HONEST):
        start = jax.tree.map(lambda x: x.copy(), state0)
        state = federated.local_steps(trainer, start, batches, LOCAL_STEPS)
        honest.append(save_tree(root / f"honest{i}", LOCAL_STEPS,
                                state.state_dict(), config_gin))  # sharded jax.Arrays
    selection, held_out = validation.from_parts(parts)
    return {"root": root, "config_gin": config_gin, "parts": parts, "base": base,
            "honest": honest, "evaluator": selection, "report_evaluator": held_out}


def save_foreign(model_dir: Path, step: int, tree: dict, config_gin: Path) -> store.Candidate:
    """A checkpoint another tool wrote with Orbax (the runtime refuses NaN states), with a
    manifest: the gate must judge its values, not its integrity."""
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True,
                                           enable_async_checkpointing=False)
    with ocp.CheckpointManager(model_dir.absolute(), options=options, item_handlers={
            "state": ocp.PyTreeCheckpointHandler(use_ocdbt=True)}) as mgr:
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)), force=True)
    integrity.write_manifest(model_dir / f"checkpoint_{step}")
    shutil.copy(config_gin, model_dir / run.CONFIG_GIN)
    return store.candidate_from_path(model_dir, name=model_dir.name)


def corrupt(setup: dict, source: store.Candidate, kind: str) -> store.Candidate:
    """A Byzantine candidate: every float leaf NaN, x100, sign-flipped or random noise."""
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    fns = {"nan": lambda x: np.full_like(x, np.nan), "scaled": lambda x: x * 100.0,
           "sign_flip": lambda x: -x,
           "noise": lambda x: rng.normal(0.0, 10.0, x.shape).astype(x.dtype)}
    tree = jax.tree.map(lambda x: fns[kind](np.asarray(x)) if np.issubdtype(
        np.asarray(x).dtype, np.floating) else np.asarray(x), read_tree(source.step_dir))
    path = setup["root"] / f"bad_{kind}"
    if path.exists():
        return store.candidate_from_path(path, name=path.name)
    return save_foreign(path, source.step, tree, setup["config_gin"])


def target_leaves(step_dir: Path) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(read_tree(step_dir)["target"])]


def test_uniform_merge_is_the_mean_and_writes_report_and_plot(setup, tmp_path) -> None:
    rep = merge(setup["honest"], MergeSpec("uniform"), tmp_path, setup["evaluator"])
    merged = Path(rep["merged_checkpoint"])
    assert merged == tmp_path / f"checkpoint_{LOCAL_STEPS}"
    cands = [target_leaves(c.step_dir) for c in setup["honest"]]
    assert not np.array_equal(cands[0][0], cands[1][0])  # the candidates really differ
    for got, *xs in zip(target_leaves(merged), *cands, strict=True):
        np.testing.assert_allclose(got, np.mean(xs, axis=0), rtol=1e-6, atol=1e-7)
    assert integrity.verify_manifest(merged) == []
    report = (tmp_path / REPORT).read_text()
    assert all(c.name in report for c in setup["honest"])
    assert rep["val_loss"]["merged"] < max(r["val_loss"] for r in rep["candidates"])
    assert (tmp_path / "merge_metrics.png").stat().st_size > 1000


def test_bit_flip_and_truncation_are_detected_and_excluded(setup, tmp_path) -> None:
    flipped, cut = tmp_path / "flipped", tmp_path / "cut"
    for dst in (flipped, cut):
        shutil.copytree(setup["honest"][0].step_dir.parent, dst)
    victim = max((p for p in (flipped / f"checkpoint_{LOCAL_STEPS}").rglob("*")
                  if p.is_file() and "ocdbt" in str(p.parent)), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    cut_file = cut / victim.relative_to(flipped)
    cut_file.write_bytes(cut_file.read_bytes()[:-7])
    step_dir = flipped / f"checkpoint_{LOCAL_STEPS}"
    problems = integrity.verify_manifest(step_dir)
    assert problems and "BLAKE3 digest differs" in problems[0] and victim.name in problems[0]
    cands = [store.candidate_from_path(flipped, "flipped"), store.candidate_from_path(cut, "cut"),
             *setup["honest"][:3]]
    with store.LeafReader() as reader:
        gate = run_gate(cands, reader, None, GateConfig(max_val_loss_ratio=None))
    assert set(gate.rejected) == {"flipped", "cut"}
    assert "corrupt" in gate.rejected["flipped"] and "truncated" in gate.rejected["cut"]


def honest_loss(setup: dict) -> float:
    """Validation loss of the honest-only uniform merge (computed once)."""
    if "honest_loss" not in setup:
        rep = merge(setup["honest"], MergeSpec("uniform"), setup["root"] / "honest_merge",
                    setup["evaluator"], OFF)
        setup["honest_loss"] = rep["val_loss"]["merged"]
    return setup["honest_loss"]


@pytest.mark.parametrize("kinds", [("nan", "scaled"), ("sign_flip", "noise")])
def test_the_attacks_wreck_a_plain_average(setup, tmp_path, kinds) -> None:
    bad = [corrupt(setup, setup["honest"][i], k) for i, k in enumerate(kinds)]
    if "nan" in kinds:  # a NaN mean is never written, gate or no gate
        with pytest.raises(ValueError, match=r"merged state not written: method=uniform gave "
                                             r"non-finite values in "):
            merge([*setup["honest"], *bad], MergeSpec("uniform"), tmp_path, setup["evaluator"],
                  OFF)
        assert checkpoints.steps(tmp_path) == [] and not (tmp_path / REPORT).exists()
        return
    naive = merge([*setup["honest"], *bad], MergeSpec("uniform"), tmp_path, setup["evaluator"], OFF)
    assert not naive["val_loss"]["merged"] <= 1.05 * honest_loss(setup), naive


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [("nan", "scaled"), ("sign_flip", "noise")])
@pytest.mark.parametrize("method", ["median", "trimmed_mean", "multi_krum", "geometric_median"])
def test_robust_methods_shrug_off_fewer_than_a_third_corrupted(setup, tmp_path, kinds,
                                                               method) -> None:
    honest = setup["honest"]
    bad = [corrupt(setup, honest[i], k) for i, k in enumerate(kinds)]
    assert len(bad) < (len(honest) + len(bad)) / 3
    got = merge([*honest, *bad], MergeSpec(method, num_byzantine=len(bad)), tmp_path,
                setup["evaluator"], OFF)
    ref_loss = honest_loss(setup)
    assert abs(got["val_loss"]["merged"] - ref_loss) <= 0.01 * ref_loss, (got["val_loss"], ref_loss)


def test_gate_rejects_every_kind_of_corrupted_candidate(setup, tmp_path) -> None:
    honest = setup["honest"]
    kinds = ("nan", "scaled", "sign_flip", "noise")
    bad = [corrupt(setup, honest[i], k) for i, k in enumerate(kinds)]
    rep = merge([*honest, *bad], MergeSpec("uniform"), tmp_path, setup["evaluator"], GateConfig())
    assert set(rep["rejections"]) == {c.name for c in bad}
    assert "non-finite" in rep["rejections"]["bad_nan"]
    assert "validation loss" in rep["rejections"]["bad_scaled"]


def test_consensus_threshold_fails_the_merge_naming_the_rejects(setup, tmp_path) -> None:
    honest = setup["honest"][:2]
    bad = [corrupt(setup, setup["honest"][0], "nan"), corrupt(setup, setup["honest"][1], "noise")]
    with pytest.raises(ConsensusError,
                       match=r"(?s)consensus not reached: 2 of 4 .*bad_nan: non-finite"):
        merge([*honest, *bad], MergeSpec("uniform"), tmp_path, setup["evaluator"],
              GateConfig(min_pass_fraction=0.75))
    assert not (tmp_path / REPORT).exists()


def test_structurally_different_candidate_is_rejected(setup, tmp_path) -> None:
    tree = read_tree(setup["honest"][0].step_dir)
    del tree["target"]["decoder_norm"]
    odd = save_tree(tmp_path / "odd", LOCAL_STEPS, tree, setup["config_gin"])
    with store.LeafReader() as reader:
        gate = run_gate([*setup["honest"][:3], odd], reader, None,
                        GateConfig(max_val_loss_ratio=None))
    assert list(gate.rejected) == ["odd"]
    assert "missing target.decoder_norm.scale" in gate.rejected["odd"]


def test_krum_selects_an_honest_candidate(setup, tmp_path) -> None:
    bad = [corrupt(setup, setup["honest"][0], "scaled"),
           corrupt(setup, setup["honest"][1], "noise")]
    rep = merge([*setup["honest"], *bad], MergeSpec("krum", num_byzantine=2), tmp_path,
                setup["evaluator"], OFF)
    chosen = [r["name"] for r in rep["candidates"] if r["weight"]]
    assert len(chosen) == 1 and chosen[0].startswith("honest")


def test_greedy_soup_is_never_worse_than_the_best_single_candidate(setup, tmp_path) -> None:
    """...on the selection batches it chooses with; held-out batches only report."""
    selection, held_out = setup["evaluator"], setup["report_evaluator"]
    assert all(not np.array_equal(a["decoder_target_tokens"], b["decoder_target_tokens"])
               for a in selection.batches for b in held_out.batches)  # disjoint sets
    cands = [*setup["honest"], corrupt(setup, setup["honest"][2], "noise")]
    rep = merge(cands, MergeSpec("greedy_soup"), tmp_path, selection, OFF,
                report_evaluator=held_out)
    best = min(r["val_loss"] for r in rep["candidates"])
    assert rep["val_loss"]["merged"] <= best + 1e-6
    assert [r for r in rep["candidates"] if r["name"] == "bad_noise"][0]["weight"] == 0.0
    params = read_tree(setup["honest"][0].step_dir)["target"]
    row = rep["candidates"][0]
    assert row["val_loss"] == pytest.approx(selection.loss(params), rel=1e-6)
    assert row["held_out_loss"] == pytest.approx(held_out.loss(params), rel=1e-6)
    assert row["val_loss"] != row["held_out_loss"]
    merged = read_tree(Path(rep["merged_checkpoint"]))["target"]
    assert rep["val_loss"]["merged"] == pytest.approx(selection.loss(merged), rel=1e-6)
    assert rep["held_out_loss"]["merged"] == pytest.approx(held_out.loss(merged), rel=1e-6)
    assert merge_report.warning_lines(rep) == []
    assert "in-sample" in merge_report.warning_lines(dict(rep, held_out_loss=None))[0]


@pytest.mark.slow
def test_learned_weights_beat_or_match_uniform_and_stay_on_the_simplex(setup, tmp_path) -> None:
    uniform = merge(setup["honest"], MergeSpec("uniform"), tmp_path / "u", setup["evaluator"])
    rep = merge(setup["honest"], MergeSpec("learned", learn_steps=3, learn_rate=0.2),
                tmp_path / "l", setup["evaluator"])
    history = rep["learned"]["loss_per_step"]
    assert history[0] == pytest.approx(uniform["val_loss"]["merged"], rel=1e-5)
    assert min(history[1:]) < history[0]  # the gradient through the real loss moves it
    assert rep["val_loss"]["merged"] == pytest.approx(min(history), rel=1e-5)
    w = np.asarray(rep["learned"]["layer_weights"])
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=1e-6)
    assert w.shape[1] > 1 and (w >= 0).all()


@pytest.mark.slow
def test_task_arithmetic_with_scale_one_over_n_is_the_mean(setup, tmp_path) -> None:
    n = len(setup["honest"])
    ta = merge(setup["honest"], MergeSpec("task_arithmetic", scale=1.0 / n), tmp_path / "ta",
               setup["evaluator"], base=setup["base"])
    uniform = merge(setup["honest"], MergeSpec("uniform"), tmp_path / "u", setup["evaluator"])
    for a, b in zip(target_leaves(Path(ta["merged_checkpoint"])),
                    target_leaves(Path(uniform["merged_checkpoint"])), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ties = merge(setup["honest"], MergeSpec("ties", density=0.5, scale=1.0), tmp_path / "ties",
                 setup["evaluator"], base=setup["base"])
    base_loss = setup["evaluator"].loss(read_tree(setup["base"].step_dir)["target"])
    assert ties["val_loss"]["merged"] < base_loss


@pytest.mark.slow
def test_fedavg_with_dp_reports_epsilon_and_learns(setup, tmp_path) -> None:
    cfg = federated.FedConfig(num_clients=2, rounds=2, local_steps=2, clip_norm=0.05,
                              noise_multiplier=0.02)
    state, rep = federated.fedavg(setup["parts"], cfg, setup["evaluator"], tmp_path)
    base_loss = setup["evaluator"].loss(read_tree(setup["base"].step_dir)["target"])
    assert rep["rounds"][-1]["val_loss"] < base_loss
    written = read_tree(Path(rep["checkpoint"]))  # T5X layout, the global parameters
    assert int(written["state"]["step"]) == 4
    assert setup["evaluator"].loss(written["target"]) == pytest.approx(
        rep["rounds"][-1]["val_loss"], rel=1e-6)
    assert integrity.verify_manifest(Path(rep["checkpoint"])) == []
    assert (tmp_path / federated.REPORT).is_file()
    assert 0 < rep["epsilon"] < float("inf") and int(state.step) == 4
    from capibara_exp.consensus import dp

    assert rep["epsilon"] == pytest.approx(dp.epsilon(0.02, 1.0, 2, 1e-5))
    assert dp.epsilon(0.5, 1.0, 2, 1e-5) < rep["epsilon"]  # more noise, less privacy loss


def test_capibara_exp_merge_config_composes_and_merges(setup, tmp_path) -> None:
    from hydra import compose, initialize_config_dir

    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.consensus.merge_command import run_merge

    runs = [str(c.step_dir) for c in setup["honest"][:3]]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("merge", overrides=[f"runs=[{','.join(runs)}]", f"out={tmp_path}",
                                          "method=median", "gate.require_manifest=true"])
    rep = run_merge(cfg)
    assert rep["method"]["method"] == "median" and len(rep["candidates"]) == 3
    assert (tmp_path / f"checkpoint_{LOCAL_STEPS}" / "capibara_manifest.json").is_file()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        bad = compose("merge", overrides=[f"runs=[{runs[0]}]", f"out={tmp_path / 'x'}",
                                          "method=soup"])
    with pytest.raises(ValueError, match="unknown merge method 'soup'"):
        run_merge(bad)


_SHARDED_SCRIPT = r"""
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from capibara_exp.consensus import methods
assert len(jax.devices()) == 4
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
rng = np.random.default_rng(0)
host = [rng.normal(size=(8, 6)).astype(np.float32) for _ in range(5)]
host[1][0, 0] = np.nan
leaves = [jax.device_put(x, sharding) for x in host]
w = [0.1, 0.2, 0.3, 0.2, 0.2]
out = methods.weighted_mean([leaves[i] for i in (0, 2, 3, 4)], [0.25] * 4)
assert out.sharding == sharding and len(out.addressable_shards) == 4
np.testing.assert_allclose(np.asarray(out), np.mean([host[i] for i in (0, 2, 3, 4)], axis=0),
                           rtol=1e-6)
med = methods.median(leaves)
assert med.sharding == sharding
np.testing.assert_allclose(np.asarray(med), np.nanmedian(np.stack(host), axis=0), rtol=1e-6)
tm = methods.trimmed_mean(leaves, 1)
srt = np.sort(np.stack(host)[:, 1:, 1:], axis=0)
np.testing.assert_allclose(np.asarray(tm)[1:, 1:], srt[1:4].astype(np.float64).mean(axis=0),
                           rtol=1e-6)
clean = [jax.device_put(x, sharding) for x in host[:1] + host[2:]]
gram = np.zeros((4, 4))
methods.gram_update(gram, clean)
x = np.stack([h.reshape(-1) for h in host[:1] + host[2:]]).astype(np.float64)
x -= x[0]
np.testing.assert_allclose(gram, x @ x.T, rtol=1e-9, atol=1e-9)
# Leaves read from a checkpoint land with their saved partition spec on this mesh.
import sys
from capibara_exp.consensus import store
cand = store.candidate_from_path(sys.argv[1])
index = store.leaf_index(cand)
spread = 0
with store.LeafReader(mesh) as sharded, store.LeafReader() as single:
    for path, info in index.items():
        a, b = sharded.read(cand, path, info), single.read(cand, path, info)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if info.spec and "model" in info.spec:
            assert a.sharding.spec == P(*info.spec), (path, a.sharding)
            spread += len({str(s.index) for s in a.addressable_shards}) > 1
assert spread > 0
print("sharded ok")
"""


def test_merges_run_shard_by_shard_on_a_device_mesh(setup) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT,
                             str(setup["honest"][0].step_dir)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "sharded ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.entry
@pytest.mark.slow
def test_capibara_exp_merge_console_script(setup, tmp_path) -> None:
    import subprocess
    import sys

    runs = ",".join(str(c.step_dir.parent) for c in setup["honest"][:3])
    script = Path(sys.executable).parent / "capibara-exp-merge"
    ok = subprocess.run([str(script), f"runs=[{runs}]", f"out={tmp_path / 'm'}", "method=median"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "m" / f"checkpoint_{LOCAL_STEPS}").is_dir()
    assert (tmp_path / "m" / REPORT).is_file() and (tmp_path / "m" / "merge_metrics.png").is_file()
    missing = subprocess.run([str(script), f"runs=[{runs}]"], capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and "missing mandatory value (???) for: out" in missing.stderr


def test_weighted_merge_follows_the_given_weights(setup, tmp_path) -> None:
    honest = setup["honest"][:3]
    one_hot = merge(honest, MergeSpec("weighted", weights=(0.0, 1.0, 0.0)), tmp_path / "a",
                    setup["evaluator"])
    for got, want in zip(target_leaves(Path(one_hot["merged_checkpoint"])),
                         target_leaves(honest[1].step_dir), strict=True):
        np.testing.assert_array_equal(got, want)
    bad = corrupt(setup, honest[0], "nan")
    rep = merge([*honest, bad], MergeSpec("weighted", weights=(1.0, 1.0, 2.0, 5.0)),
                tmp_path / "b", setup["evaluator"])
    assert [r["weight"] for r in rep["candidates"]] == [0.25, 0.25, 0.5, None]  # renormalised
    with pytest.raises(ValueError, match="one weight per candidate"):
        merge(honest, MergeSpec("weighted", weights=(1.0,)), tmp_path / "c", setup["evaluator"])


def compose_merge(runs: list, out: Path, overrides: list[str]):
    """conf/merge.yaml as `capibara-exp-merge` composes it."""
    from hydra import compose, initialize_config_dir

    from capibara_exp.base.paths import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("merge", overrides=[f"runs=[{','.join(str(r) for r in runs)}]",
                                           f"out={out}", *overrides])


def test_checksum_action_gives_manifests_to_checkpoints_written_without_them(setup,
                                                                             tmp_path) -> None:
    """Real T5X writes no manifest: the action (bound in config.gin) writes it after the save."""
    model_dir = tmp_path / "t5x_run"
    shutil.copytree(setup["honest"][0].step_dir.parent, model_dir)
    step_dir = model_dir / f"checkpoint_{LOCAL_STEPS}"
    (step_dir / integrity.MANIFEST).unlink()
    in_flight = model_dir / f"checkpoint_{2 * LOCAL_STEPS}.orbax-checkpoint-tmp-1"
    shutil.copytree(step_dir, in_flight)  # Orbax renames it when finished: not yet a checkpoint
    assert integrity.verify_manifest(step_dir) is None
    act = action.ChecksumCheckpoints(str(model_dir))
    assert act.run(TrainState(step=LOCAL_STEPS, params=None, opt_state=None), {}) is False
    assert act.manifests_written == [step_dir / integrity.MANIFEST]
    assert integrity.verify_manifest(step_dir) == []
    assert not (in_flight / integrity.MANIFEST).exists()
    act.run(TrainState(step=LOCAL_STEPS, params=None, opt_state=None), {})
    assert len(act.manifests_written) == 1  # an existing manifest is never rewritten
    victim = max((p for p in step_dir.rglob("*") if p.is_file() and "ocdbt" in str(p.parent)),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))  # damage after the manifest: a merge now catches it
    assert "BLAKE3 digest differs" in integrity.verify_manifest(step_dir)[0]
    # ConsensusMerge does the same on every call before its final merge.
    (step_dir / integrity.MANIFEST).unlink()
    merge_act = action.ConsensusMerge(str(model_dir), total_steps=100)
    merge_act.run(TrainState(step=LOCAL_STEPS, params=None, opt_state=None), {})
    assert merge_act.manifests_written == [step_dir / integrity.MANIFEST]
    assert merge_act.fired_at is None


def test_no_manifest_is_rejected_by_default_or_merged_marked_unverified(setup, tmp_path) -> None:
    from omegaconf import OmegaConf

    bare = tmp_path / "nomanifest"
    shutil.copytree(setup["honest"][0].step_dir.parent, bare)
    (bare / f"checkpoint_{LOCAL_STEPS}" / integrity.MANIFEST).unlink()
    cands = [store.candidate_from_path(bare, "bare"), *setup["honest"][1:3]]

    def shipped_gate(*overrides: str) -> GateConfig:  # conf/merge.yaml's gate
        cfg = compose_merge(["unused"], tmp_path, ["gate.max_val_loss_ratio=null", *overrides])
        return GateConfig(**OmegaConf.to_container(cfg.gate))

    strict = merge(cands, MergeSpec("uniform"), tmp_path / "strict", None, shipped_gate())
    assert "no checksum manifest" in strict["rejections"]["bare"]
    assert "require_manifest=false" in strict["rejections"]["bare"] and strict["unverified"] == []
    assert merge_report.warning_lines(strict) == [f"rejected bare: {strict['rejections']['bare']}"]
    lenient = merge(cands, MergeSpec("uniform"), tmp_path / "lenient", None,
                    shipped_gate("gate.require_manifest=false"))
    assert [(r["accepted"], r["integrity"]) for r in lenient["candidates"]] == [
        (True, "unverified"), (True, "verified"), (True, "verified")]
    assert lenient["unverified"] == ["bare"]
    assert "integrity unverified: bare" in merge_report.warning_lines(lenient)[0]


def run_merge_cfg(cfg) -> dict:
    from capibara_exp.consensus.merge_command import run_merge

    return run_merge(cfg)


def test_merge_cli_runs_on_bare_checkpoints_when_nothing_needs_validation(setup,
                                                                          tmp_path) -> None:
    runs = []
    for c in setup["honest"][:3]:  # checkpoint dirs with no config.gin above them
        dst = tmp_path / "bare" / c.step_dir.parent.name / c.step_dir.name
        shutil.copytree(c.step_dir, dst)
        runs.append(dst)
    with pytest.raises(ConfigError, match="no config.gin"):
        run.find_config_gin(runs[0])
    out = tmp_path / "m"
    rep = run_merge_cfg(compose_merge(runs, out, ["method=median",
                                                  "gate.max_val_loss_ratio=null"]))
    assert rep["val_loss"]["merged"] is None and rep["held_out_loss"] is None
    assert not (out / "merge_metrics.png").exists() and (out / REPORT).is_file()
    got = target_leaves(Path(rep["merged_checkpoint"]))
    cands = [target_leaves(r) for r in runs]
    np.testing.assert_allclose(got[0], np.median([c[0] for c in cands], axis=0), rtol=1e-6)
    for extra, key in ((["method=median"], "gate.max_val_loss_ratio=1.5"),
                       (["method=greedy_soup", "gate.max_val_loss_ratio=null"],
                        "method=greedy_soup")):
        with pytest.raises(ConfigError, match=rf"{key} need validation batches.*eval_config="):
            run_merge_cfg(compose_merge(runs, tmp_path / "x", extra))


def test_ties_thresholds_are_exact_over_the_whole_task_vector() -> None:
    rng = np.random.default_rng(0)
    # Two candidates' task vectors over three leaves: one leaf moved a lot, two barely.
    leaves = [[rng.normal(0.0, scale, shape).astype(np.float32) for _ in range(2)]
              for scale, shape in ((1.0, (300,)), (1e-3, (500,)), (1e-3, (20, 10)))]
    leaves[0][1][:40] = leaves[0][1][40]  # equal magnitudes around the cut
    density = 0.25
    got = methods.ties_thresholds(lambda: iter(leaves), density)
    for i in range(2):
        mags = np.sort(np.concatenate([np.abs(leaf[i]).ravel() for leaf in leaves]))[::-1]
        assert got[i] == mags[round(density * mags.size) - 1]
    # Trimmed over the whole task vector, the barely-moved leaves keep nothing (a per-leaf
    # trim would keep a quarter of each).
    assert not np.any(np.asarray(methods.ties(leaves[1], np.zeros(500, np.float32), got, 1.0)))
    kept = np.asarray(methods.ties(leaves[0], np.zeros(300, np.float32), got, 1.0))
    assert 0 < np.count_nonzero(kept) <= 300
    with pytest.raises(ValueError, match="density must be in"):
        methods.ties_thresholds(lambda: iter(leaves), 0.0)


def test_fedavg_from_the_merge_config_advances_the_schedule_across_rounds(setup,
                                                                          tmp_path) -> None:
    cfg = compose_merge([setup["honest"][0].step_dir.parent], tmp_path,
                        ["method=fedavg", "fedavg.num_clients=1", "fedavg.rounds=2",
                         "fedavg.local_steps=1", "eval_batches=0"])
    rep = run_merge_cfg(cfg)
    first, second = rep["rounds"]
    # schedule.warmup_steps=2: step 0's rate is the schedule's floor, step 1's half the base.
    assert (first["first_step"], second["first_step"]) == (0, 1)
    assert first["learning_rate"] < 1e-7 < 1e-4 < second["learning_rate"]
    # Round 2 really steps at step 1's rate (fresh Adam moments, so an update's size
    # follows the rate): were the schedule restarted, both updates would be alike.
    assert second["update_norm"] > 1000 * first["update_norm"] > 0
    written = read_tree(Path(rep["checkpoint"]))
    assert int(written["state"]["step"]) == 2 and first["val_loss"] is None
    assert (tmp_path / federated.REPORT).is_file()


@pytest.mark.parametrize("spec", [
    MergeSpec("slerp", t=[0.2, 0.8]), MergeSpec("model_stock"),
    MergeSpec("dare_ties", density=0.5), MergeSpec("dare_linear", density=0.5),
    MergeSpec("breadcrumbs", density=0.6, gamma=0.05), MergeSpec("della", density=0.5)],
    ids=lambda s: s.method)
def test_new_methods_on_real_runs_match_the_references(setup, tmp_path, spec) -> None:
    """The real tiny runs' checkpoints, merged; every parameter against the reference on
    the leaves as read back, and the merge keeps what training learned."""
    from capibara_exp.consensus import task_vectors
    from tests import merge_references as ref

    cands = setup["honest"][:2] if spec.method == "slerp" else setup["honest"][:3]
    rep = merge(cands, spec, tmp_path, setup["evaluator"], OFF,
                base=None if spec.method == "slerp" else setup["base"])
    merged = read_tree(Path(rep["merged_checkpoint"]))["target"]
    trees = [jax.tree.map(np.asarray, read_tree(c.step_dir)["target"]) for c in cands]
    base = jax.tree.map(np.asarray, read_tree(setup["base"].step_dir)["target"])
    flat = jax.tree_util.tree_flatten_with_path(merged)[0]
    for (path, got), *xs, b in zip(flat, *(jax.tree.leaves(t) for t in trees),
                                   jax.tree.leaves(base), strict=True):
        keys = tuple(str(k.key) for k in path)
        if spec.method == "slerp":
            continue  # the per-layer factors are checked on small pytrees; the loss below
        if spec.method == "model_stock":
            want = ref.model_stock(xs, b)
        elif spec.method.startswith("dare"):
            tvs = [ref.dare_sparsify(x - b, task_vectors.uniforms(0, c.name, keys, b.shape) < 0.5,
                                     0.5) for x, c in zip(xs, cands, strict=True)]
            want = b + (ref.sign_elect_merge(tvs, [1.0] * 3, False) if spec.method == "dare_ties"
                        else ref.linear_merge(tvs, [1.0] * 3, False))
        elif spec.method == "breadcrumbs":
            want = b + ref.linear_merge([ref.breadcrumbs_sparsify(x - b, 0.6, 0.05) for x in xs],
                                        [1.0] * 3, False)
        else:
            tvs = [ref.della_sparsify(x - b, 0.5, 0.15, task_vectors.uniforms(0, c.name, keys,
                                                                              b.shape))
                   for x, c in zip(xs, cands, strict=True)]
            want = b + ref.sign_elect_merge(tvs, [1.0] * 3, True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5,
                                   err_msg="/".join(keys))
    base_loss = setup["evaluator"].loss(base)
    assert rep["val_loss"]["merged"] < base_loss, (rep["val_loss"], base_loss)
