"""SLERP, Model Stock, DARE, Model Breadcrumbs and DELLA against NumPy references written
from their papers (tests/merge_references.py), through merge() on small pytrees saved as
T5X-layout checkpoints; and their building blocks' properties."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from capibara_exp.composing.merge_methods import MergeSpec
from capibara_exp.consensus import interpolate, store, task_vectors
from capibara_exp.consensus.gate import GateConfig
from capibara_exp.consensus.merge import merge
from capibara_exp.runtime import checkpoints
from tests import merge_references as ref

NO_LOSS = GateConfig(max_val_loss_ratio=None)
SHAPES = {("token_embedder", "embedding"): (8, 4), ("layers_0", "mlp", "wi", "kernel"): (4, 6),
          ("layers_1", "mlp", "wi", "kernel"): (4, 6), ("layers_2", "mlp", "wi", "kernel"): (4, 6),
          ("layers_3", "mlp", "wi", "kernel"): (4, 6), ("decoder_norm", "scale"): (4,)}


def _tree(params: dict, step: int) -> dict:
    return {"state": {"step": np.int32(step)}, "target": store.unflatten(params)}


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> dict:
    """A base and four fine-tunes of it (small moves, so their task vectors differ)."""
    root = tmp_path_factory.mktemp("pytrees")
    rng = np.random.default_rng(0)
    base = {p: rng.normal(size=s).astype(np.float32) for p, s in SHAPES.items()}
    out = {"base_params": base, "params": []}
    for name, params in [("base", base)] + [
            (f"ft{i}", {p: v + rng.normal(0.0, 0.3, v.shape).astype(np.float32)
                        for p, v in base.items()}) for i in range(4)]:
        mgr = checkpoints.manager(root / name)
        checkpoints.save(mgr, 0 if name == "base" else 5, _tree(params, 0 if name == "base" else 5))
        mgr.close()
        cand = store.candidate_from_path(root / name, name=name)
        if name == "base":
            out["base"] = cand
        else:
            out.setdefault("cands", []).append(cand)
            out["params"].append(params)
    return out


def merged_params(rep: dict) -> dict:
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(Path(rep["merged_checkpoint"]) / "state")["target"]
    return {p: np.asarray(_get(tree, p)) for p in SHAPES}


def _get(tree: dict, path: tuple) -> np.ndarray:
    for key in path:
        tree = tree[key]
    return tree


def test_slerp_with_per_layer_factors_matches_the_reference(pool, tmp_path) -> None:
    anchors = [0.0, 0.3, 1.0]
    rep = merge(pool["cands"][:2], MergeSpec("slerp", t=anchors), tmp_path, gate_cfg=NO_LOSS)
    got, (a, b) = merged_params(rep), pool["params"][:2]
    for i in range(4):
        p = (f"layers_{i}", "mlp", "wi", "kernel")
        want = ref.slerp(ref.layer_factor(anchors, i, 4), a[p], b[p])
        np.testing.assert_allclose(got[p], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[("layers_0", "mlp", "wi", "kernel")],
                                  a[("layers_0", "mlp", "wi", "kernel")])  # t = 0: the first
    emb, norm = ("token_embedder", "embedding"), ("decoder_norm", "scale")
    np.testing.assert_allclose(got[emb], ref.slerp(0.0, a[emb], b[emb]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[norm], ref.slerp(1.0, a[norm], b[norm]), rtol=1e-5, atol=1e-6)
    single = merge(pool["cands"][:2], MergeSpec("slerp", t=0.4), tmp_path / "one",
                   gate_cfg=NO_LOSS)
    np.testing.assert_allclose(merged_params(single)[emb], ref.slerp(0.4, a[emb], b[emb]),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="method=slerp merges exactly 2 candidates, got 3"):
        merge(pool["cands"][:3], MergeSpec("slerp"), tmp_path / "three", gate_cfg=NO_LOSS)


def test_slerp_is_linear_for_nearly_parallel_leaves_and_keeps_unit_length() -> None:
    a = np.array([1.0, 0.0, 0.0], np.float32)
    b = np.array([0.0, 1.0, 0.0], np.float32)
    mid = interpolate.slerp(0.5, a, b)
    np.testing.assert_allclose(np.linalg.norm(mid), 1.0, rtol=1e-6)  # a lerp would be 0.707
    c = np.array([1.0, 1e-3, 0.0], np.float32)
    np.testing.assert_allclose(interpolate.slerp(0.25, a, c), 0.75 * a + 0.25 * c, rtol=1e-6)


def test_model_stock_matches_the_reference(pool, tmp_path) -> None:
    rep = merge(pool["cands"][:3], MergeSpec("model_stock"), tmp_path, gate_cfg=NO_LOSS,
                base=pool["base"])
    got = merged_params(rep)
    for p in SHAPES:
        want = ref.model_stock([x[p] for x in pool["params"][:3]], pool["base_params"][p])
        np.testing.assert_allclose(got[p], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, normalize", [("dare_ties", None), ("dare_linear", True)])
def test_dare_matches_the_reference(pool, tmp_path, method, normalize) -> None:
    weights, density = (1.0, 2.0, 0.5), 0.6
    spec = MergeSpec(method, weights=weights, density=density, scale=0.8, normalize=normalize,
                     seed=7)
    rep = merge(pool["cands"][:3], spec, tmp_path, gate_cfg=NO_LOSS, base=pool["base"])
    got = merged_params(rep)
    for p in SHAPES:
        b = pool["base_params"][p]
        tvs = [ref.dare_sparsify(x[p] - b, task_vectors.uniforms(7, c.name, p, b.shape) < density,
                                 density)
               for x, c in zip(pool["params"][:3], pool["cands"][:3], strict=True)]
        mixed = (ref.sign_elect_merge(tvs, list(weights), False) if method == "dare_ties"
                 else ref.linear_merge(tvs, list(weights), True))
        np.testing.assert_allclose(got[p], b + 0.8 * mixed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
def test_breadcrumbs_matches_the_reference(pool, tmp_path, method) -> None:
    spec = MergeSpec(method, density=0.5, gamma=0.1)
    rep = merge(pool["cands"][:3], spec, tmp_path, gate_cfg=NO_LOSS, base=pool["base"])
    got = merged_params(rep)
    for p in SHAPES:
        b = pool["base_params"][p]
        tvs = [ref.breadcrumbs_sparsify(x[p] - b, 0.5, 0.1) for x in pool["params"][:3]]
        mixed = (ref.sign_elect_merge(tvs, [1.0] * 3, False) if method == "breadcrumbs_ties"
                 else ref.linear_merge(tvs, [1.0] * 3, False))
        np.testing.assert_allclose(got[p], b + mixed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_matches_the_reference(pool, tmp_path, method) -> None:
    spec = MergeSpec(method, density=0.5, epsilon=0.2, weights=(1.0, 1.0, 3.0))
    rep = merge(pool["cands"][:3], spec, tmp_path, gate_cfg=NO_LOSS, base=pool["base"])
    got = merged_params(rep)
    for p in SHAPES:
        b = pool["base_params"][p]
        tvs = [ref.della_sparsify(x[p] - b, 0.5, 0.2, task_vectors.uniforms(0, c.name, p, b.shape))
               for x, c in zip(pool["params"][:3], pool["cands"][:3], strict=True)]
        mixed = (ref.sign_elect_merge(tvs, [1.0, 1.0, 3.0], True) if method == "della"
                 else ref.linear_merge(tvs, [1.0, 1.0, 3.0], False))
        np.testing.assert_allclose(got[p], b + mixed, rtol=1e-5, atol=1e-5)


def test_random_masks_keep_density_in_expectation_and_follow_the_seed() -> None:
    u = task_vectors.uniforms(3, "a", ("x",), (200_000,))
    kept = float(np.mean(u < 0.3))
    assert abs(kept - 0.3) < 5 * np.sqrt(0.3 * 0.7 / u.size)  # five standard deviations
    np.testing.assert_array_equal(u, task_vectors.uniforms(3, "a", ("x",), (200_000,)))
    assert not np.array_equal(u, task_vectors.uniforms(3, "b", ("x",), (200_000,)))
    assert not np.array_equal(u, task_vectors.uniforms(4, "a", ("x",), (200_000,)))
    tv = np.ones(200_000, np.float32)
    assert abs(float(task_vectors.dare(tv, 0.3, u).mean()) - 1.0) < 0.02  # unbiased
    p = task_vectors.della_keep_probability(np.arange(1, 101, dtype=np.float32), 0.4, 0.1)
    np.testing.assert_allclose([p[0], p[-1], p.mean()], [0.3, 0.5, 0.4], rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "della", "density": 0.1}, r"density -/\+ epsilon must lie in \(0, 1\)"),
    ({"method": "slerp", "t": 1.5}, r"t: must be a number in \[0, 1\]"),
    ({"method": "slerp", "t": []}, r"t: must be a number in \[0, 1\] or a non-empty list"),
    ({"method": "breadcrumbs", "gamma": 1.0}, r"gamma: must be in \[0, 1\)"),
    ({"method": "dare_ties", "gamma": 0.2}, "gamma=0.2 is not a parameter of method=dare_ties"),
])
def test_bad_parameters_of_the_new_methods_are_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MergeSpec(**kwargs)


def test_moe_expert_leaves_keep_their_expert_axis_on_a_mesh_that_has_one() -> None:
    """A MoE checkpoint's expert kernels were saved sharded over `expert`: a merge mesh with
    that axis places them so; one without it replicates them instead of failing."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    info = store.LeafInfo((4, 8, 16), np.dtype(np.float32), ("expert", None, "model"))
    devices = np.array(jax.devices()[:1])
    with_expert = Mesh(devices.reshape(1, 1, 1), ("data", "expert", "model"))
    assert store.sharding_for(info, with_expert).spec == PartitionSpec("expert", None, "model")
    plain = Mesh(devices.reshape(1, 1), ("data", "model"))
    assert store.sharding_for(info, plain).spec == PartitionSpec()
