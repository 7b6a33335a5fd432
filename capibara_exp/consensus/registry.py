"""The merge methods bound to how they run: each method of merge_methods.METHODS (the
table configs are checked against) with its solver (weights over the accepted candidates)
and its per-leaf function. merge() reads this table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from capibara_exp.composing import merge_methods
from capibara_exp.composing.merge_methods import MergeSpec
from capibara_exp.consensus.base_merges import slerp_leaf, solve_pool, with_base

# ---- solvers: weights over the accepted candidates (or the method's own solution) ---------

@dataclasses.dataclass
class Solve:
    """What a solver sees: the spec, the gate's result, the reader, the selection
    evaluator, every candidate's name (the order weights are given in) and the base."""

    spec: MergeSpec
    gate: Any
    reader: Any
    evaluator: Any
    names: Sequence[str]
    base: tuple | None  # (reader, base candidate, its leaf index)


def _uniform(s: Solve) -> dict:
    from capibara_exp.consensus import methods

    return {"weights": methods.uniform_weights(len(s.gate.accepted))}


def _weighted(s: Solve) -> dict:
    if s.spec.weights is None:
        raise ValueError("weights: method=weighted needs one weight per candidate, got null")
    by_name = dict(zip(s.names, s.spec.weights, strict=True))
    w = np.array([by_name[c.name] for c in s.gate.accepted], np.float64)
    if not w.sum() > 0:
        raise ValueError(f"weights: the candidates that passed the gate have weights summing to "
                         f"0 ({list(s.spec.weights)!r})")
    return {"weights": w / w.sum()}  # renormalised over the candidates that passed


def _greedy(s: Solve) -> dict:
    from capibara_exp.consensus import soups

    w, log = soups.greedy_soup(s.gate.accepted, s.gate.val_loss, s.reader, s.gate.index,
                               s.evaluator)
    return {"weights": w, "greedy_log": log}


def _learned(s: Solve) -> dict:
    from capibara_exp.consensus import soups

    w, group_of, hist = soups.learned_weights(s.gate.accepted, s.reader, s.gate.index,
                                              s.evaluator, s.spec.learn_steps,
                                              s.spec.learn_rate, s.spec.per_layer)
    return {"weights": w.mean(axis=1), "layer_weights": w, "group_of": group_of,
            "learn_history": hist}


def _krum(s: Solve) -> dict:
    from capibara_exp.consensus import methods

    n, f = len(s.gate.accepted), s.spec.num_byzantine
    selected = 1 if s.spec.method == "krum" else (s.spec.num_selected or n - f)
    return {"weights": methods.krum_weights(s.gate.gram, f, selected)}


def _geometric_median(s: Solve) -> dict:
    from capibara_exp.consensus import methods

    return {"weights": methods.geometric_median_weights(s.gate.gram)}


def _task_vectors(s: Solve) -> Callable:
    """A callable yielding, leaf by leaf, the accepted candidates' float task vectors."""
    reader, base, base_index = s.base

    def leaves():
        for p, info in s.gate.index.items():
            if p[:1] == ("target",) and np.issubdtype(info.dtype, np.floating):
                b = np.asarray(reader.read(base, p, base_index[p]), np.float32)
                yield [np.asarray(reader.read(c, p, info), np.float32) - b
                       for c in s.gate.accepted]
    return leaves


def _ties_thresholds(s: Solve) -> dict:
    from capibara_exp.consensus import methods

    return {"ties_thresholds": methods.ties_thresholds(_task_vectors(s), s.spec.density)}


# ---- per-leaf functions: fn(path, leaves) -> merged leaf (leaves are fresh reads) ---------

def _median_leaf(spec: MergeSpec, solved: dict, base: tuple | None) -> Callable:
    from capibara_exp.consensus import methods

    return lambda path, leaves: methods.median(leaves, overwrite_input=True)


def _trimmed_leaf(spec: MergeSpec, solved: dict, base: tuple | None) -> Callable:
    from capibara_exp.consensus import methods

    return lambda path, leaves: methods.trimmed_mean(leaves, spec.num_byzantine,
                                                     overwrite_input=True)




@dataclasses.dataclass(frozen=True)
class Method(merge_methods.Method):
    """A merge method of the table and how it runs."""

    solve: Callable[[Solve], dict] | None = None
    leaf: Callable[[MergeSpec, dict, tuple | None], Callable] | None = None


# How each method runs: its solver and its per-leaf function (None: the default mean).
_RUNS: dict[str, tuple[Callable | None, Callable | None]] = {
    "uniform": (_uniform, None),
    "weighted": (_weighted, None),
    "greedy_soup": (_greedy, None),
    "learned": (_learned, None),
    "median": (None, _median_leaf),
    "trimmed_mean": (None, _trimmed_leaf),
    "krum": (_krum, None),
    "multi_krum": (_krum, None),
    "geometric_median": (_geometric_median, None),
    "task_arithmetic": (None, with_base),
    "ties": (_ties_thresholds, with_base),
    "slerp": (solve_pool, slerp_leaf),
    "model_stock": (solve_pool, with_base),
    **dict.fromkeys(("dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della",
                     "della_linear"), (solve_pool, with_base)),
}
METHODS: dict[str, Method] = {
    name: Method(**vars(facts), solve=_RUNS[name][0], leaf=_RUNS[name][1])
    for name, facts in merge_methods.METHODS.items()}
