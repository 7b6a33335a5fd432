"""Per-leaf functions of the merges that work on task vectors or interpolate (the
registry's `leaf` entries for task arithmetic, TIES, DARE, Model Breadcrumbs, DELLA, Model
Stock and SLERP), and their solver: which candidates take part, in which order, with
which weights and which layer each leaf belongs to.

Each is `leaf(spec, solved, base) -> fn(path, leaves) -> merged leaf`; `base` is (reader,
base candidate, its leaf index). Leaves are host arrays (a merge on a device mesh brings
each leaf of these methods to the host). The optimizer state and step are averaged (the
largest step), as for TIES.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# interpolate, methods and task_vectors (JAX) are imported where a merge runs: the registry
# imports this module to check a command line's merge settings, before anything heavy loads.

TARGET = ("target",)
# name -> (sparsification, sign consensus, default of `normalize`), as mergekit defines them
TASK_VECTOR_METHODS: dict[str, tuple[str | None, bool, bool]] = {
    "dare_ties": ("dare", True, False),
    "dare_linear": ("dare", False, False),
    "breadcrumbs": ("breadcrumbs", False, False),
    "breadcrumbs_ties": ("breadcrumbs", True, False),
    "della": ("della", True, True),
    "della_linear": ("della", False, False),
}


def solve_pool(s: Any) -> dict:
    """The accepted candidates' names and weights (given ones by name, else 1 each), and
    each parameter's layer position (SLERP's per-layer factors)."""
    from capibara_exp.consensus import interpolate

    names = [c.name for c in s.gate.accepted]
    weights = np.ones(len(names))
    if s.spec.weights is not None:
        by_name = dict(zip(s.names, s.spec.weights, strict=True))
        weights = np.array([by_name[n] for n in names], np.float64)
    paths = [p[1:] for p in s.gate.index if p[:1] == TARGET]
    shapes = {p[1:]: info.shape for p, info in s.gate.index.items() if p[:1] == TARGET}
    return {"names": names, "tv_weights": weights,
            "layer_position": interpolate.layer_positions(paths, shapes)}


def effective_normalize(spec: Any) -> bool:
    """`normalize` as given, or the method's default (mergekit's)."""
    if spec.normalize is not None:
        return bool(spec.normalize)
    return TASK_VECTOR_METHODS[spec.method][2]


def _sparsify(spec: Any, tv: np.ndarray, name: str, path: tuple) -> np.ndarray:
    from capibara_exp.consensus import task_vectors

    kind = TASK_VECTOR_METHODS[spec.method][0]
    if kind == "breadcrumbs":
        return task_vectors.breadcrumbs(tv, spec.density, spec.gamma)
    u = task_vectors.uniforms(spec.seed, name, path, tv.shape)
    if kind == "dare":
        return task_vectors.dare(tv, spec.density, u, spec.rescale)
    return task_vectors.della(tv, spec.density, spec.epsilon, u, spec.rescale)


def _task_vector_leaf(spec: Any, solved: dict, base32: np.ndarray, leaves: list,
                      path: tuple) -> np.ndarray:
    from capibara_exp.consensus import task_vectors

    tvs = [_sparsify(spec, np.asarray(x, np.float32) - base32, name, path)
           for x, name in zip(leaves, solved["names"], strict=True)]
    mixed = task_vectors.combine(tvs, solved["tv_weights"], TASK_VECTOR_METHODS[spec.method][1],
                                 effective_normalize(spec))
    return base32 + np.float32(spec.scale) * mixed


def with_base(spec: Any, solved: dict, base: tuple) -> Callable:
    """Task arithmetic, TIES, the sparsified task-vector methods and Model Stock."""
    from capibara_exp.consensus import interpolate, methods

    reader, candidate, index = base

    def leaf(path, leaves):
        if path[:1] != TARGET:  # optimizer state and step: mean / max
            return methods.weighted_mean(leaves, methods.uniform_weights(len(leaves)),
                                         overwrite_input=True)
        b = reader.read(candidate, path, index[path])
        if not np.issubdtype(np.asarray(b).dtype, np.floating):
            return methods.weighted_mean(leaves, methods.uniform_weights(len(leaves)))
        if spec.method == "ties":
            return methods.ties(leaves, b, solved["ties_thresholds"], spec.scale)
        if spec.method == "task_arithmetic":
            return methods.task_arithmetic(leaves, b, spec.scale)
        host = [np.asarray(x) for x in leaves]
        if spec.method == "model_stock":
            return interpolate.model_stock(host, np.asarray(b))
        base32 = np.asarray(b, np.float32)
        return _task_vector_leaf(spec, solved, base32, host, path[1:]).astype(b.dtype)
    return leaf


def slerp_leaf(spec: Any, solved: dict, base: tuple | None) -> Callable:
    """SLERP of the two accepted candidates, the first at t = 0."""
    from capibara_exp.consensus import interpolate, methods

    def leaf(path, leaves):
        a, b = (np.asarray(x) for x in leaves)
        if path[:1] != TARGET or not np.issubdtype(a.dtype, np.floating):
            return methods.weighted_mean(leaves, [0.5, 0.5])
        t = interpolate.slerp_factor(spec.t, solved["layer_position"][path[1:]])
        return interpolate.slerp(t, a, b)
    return leaf
