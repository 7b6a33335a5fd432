"""The merge: gate the candidates, solve the method, stream every leaf, write and report.

`merge()` is the one entry point the action, the Hydra callback, the console script and
the federated rounds share.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capibara_exp.consensus import methods, report, soups
from capibara_exp.consensus.gate import GateConfig, GateResult, run_gate
from capibara_exp.consensus.store import Candidate, LeafReader, leaf_index, unflatten, write

METHODS = ("uniform", "weighted", "greedy_soup", "learned", "median", "trimmed_mean", "krum",
           "multi_krum", "geometric_median", "task_arithmetic", "ties")
REPORT = "merge_report.json"
PLOT = "merge_metrics.png"


@dataclasses.dataclass(frozen=True)
class MergeSpec:
    """A merge method and its parameters (conf/consensus and conf/merge.yaml keys)."""

    method: str = "uniform"
    weights: Sequence[float] | None = None  # weighted: one per candidate (normalised)
    num_byzantine: int = 0                  # f: Krum's and the trimmed mean's tolerance
    num_selected: int | None = None         # multi-Krum: candidates averaged (default n - f)
    scale: float = 1.0                      # task arithmetic / TIES: lambda
    density: float = 0.2                    # TIES: share of each task vector kept
    learn_steps: int = 10                   # learned: optimiser steps
    learn_rate: float = 0.05                # learned: Adam learning rate on the logits
    per_layer: bool = True                  # learned: one weight per candidate and layer

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: unknown merge method {self.method!r} (choose from "
                             f"{', '.join(METHODS)})")
        if self.num_byzantine < 0:
            raise ValueError(f"num_byzantine must be >= 0, got {self.num_byzantine}")
        if self.method == "ties" and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density: ties keeps a share in (0, 1], got {self.density}")


NEEDS_VALIDATION = ("greedy_soup", "learned")


def evaluation_needs(spec: MergeSpec, gate: GateConfig) -> list[str]:
    """The settings (key=value) that need validation batches; [] when none does."""
    return ([f"method={spec.method}"] if spec.method in NEEDS_VALIDATION else []) + [
        f"gate.{check}" for check in gate.loss_checks()]


def _gram(candidates, reader, index) -> np.ndarray:
    gram = np.zeros((len(candidates), len(candidates)))
    for p in index:
        if p[:1] == ("target",):
            methods.gram_update(gram, [reader.read(c, p, index[p]) for c in candidates])
    return gram


def _task_vectors(gate: GateResult, base_reader: tuple):
    """A callable yielding, leaf by leaf, the accepted candidates' float task vectors."""
    reader, base, base_index = base_reader

    def leaves():
        for p, info in gate.index.items():
            if p[:1] == ("target",) and np.issubdtype(info.dtype, np.floating):
                b = np.asarray(reader.read(base, p, base_index[p]), np.float32)
                yield [np.asarray(reader.read(c, p, info), np.float32) - b for c in gate.accepted]
    return leaves


def solve(spec: MergeSpec, gate: GateResult, reader: LeafReader, evaluator: Any,
          names: Sequence[str], base_reader: tuple | None = None) -> dict:
    """Weights over the accepted candidates (per layer too for `learned`) and solver details;
    for the per-leaf methods {}, or TIES's per-candidate trim thresholds. `names`: every
    candidate, in the order weights are given."""
    cands, n = gate.accepted, len(gate.accepted)
    m = spec.method
    if m == "ties":  # two streaming passes over the task vectors, before the merge pass
        return {"ties_thresholds": methods.ties_thresholds(_task_vectors(gate, base_reader),
                                                           spec.density)}
    if m == "uniform":
        return {"weights": methods.uniform_weights(n)}
    if m == "weighted":
        if spec.weights is None or len(spec.weights) != len(names):
            raise ValueError(f"weights: method=weighted needs one weight per candidate "
                             f"({len(names)}), got {spec.weights!r}")
        by_name = dict(zip(names, spec.weights, strict=True))
        w = np.array([by_name[c.name] for c in cands], np.float64)
        if not (np.all(w >= 0) and w.sum() > 0):
            raise ValueError(f"weights: must be >= 0 with a positive sum over the accepted "
                             f"candidates, got {spec.weights!r}")
        return {"weights": w / w.sum()}  # renormalised over the candidates that passed
    if m == "greedy_soup":
        w, log = soups.greedy_soup(cands, gate.val_loss, reader, gate.index, evaluator)
        return {"weights": w, "greedy_log": log}
    if m == "learned":
        w, group_of, hist = soups.learned_weights(cands, reader, gate.index, evaluator,
                                                  spec.learn_steps, spec.learn_rate, spec.per_layer)
        return {"weights": w.mean(axis=1), "layer_weights": w, "group_of": group_of,
                "learn_history": hist}
    if m in ("krum", "multi_krum"):
        selected = 1 if m == "krum" else (spec.num_selected or n - spec.num_byzantine)
        return {"weights": methods.krum_weights(_gram(cands, reader, gate.index),
                                                spec.num_byzantine, selected)}
    if m == "geometric_median":
        return {"weights": methods.geometric_median_weights(_gram(cands, reader, gate.index))}
    return {}


def _leaf_fn(spec: MergeSpec, solved: dict, base_reader: tuple | None):
    """fn(path, leaves) -> merged leaf; the leaves are fresh reads it may overwrite."""
    m = spec.method
    if m == "median":
        return lambda path, leaves: methods.median(leaves, overwrite_input=True)
    if m == "trimmed_mean":
        return lambda path, leaves: methods.trimmed_mean(leaves, spec.num_byzantine,
                                                         overwrite_input=True)
    if m in ("task_arithmetic", "ties"):
        reader, base, index = base_reader

        def with_base(path, leaves):
            if path[:1] != ("target",):  # optimizer state and step: mean / max
                return methods.weighted_mean(leaves, methods.uniform_weights(len(leaves)),
                                             overwrite_input=True)
            b = reader.read(base, path, index[path])
            if m == "ties":
                return methods.ties(leaves, b, solved["ties_thresholds"], spec.scale)
            return methods.task_arithmetic(leaves, b, spec.scale)
        return with_base
    raise AssertionError(f"{m}: a weight method reached the per-leaf dispatch")


def _leaf_weights(solved: dict, path: tuple) -> np.ndarray | None:
    """This leaf's weights: per layer for `learned` parameters; the optimizer state of
    `learned` takes each candidate's mean layer weight."""
    if "layer_weights" in solved and path in solved["group_of"]:
        return solved["layer_weights"][:, solved["group_of"][path]]
    return solved.get("weights")


def _merge_leaves(gate: GateResult, solved: dict, fn: Any, reader: LeafReader) -> dict:
    """The streaming pass: one leaf of each candidate at a time. The leaves are fresh
    reads this pass owns, so the aggregators write into the first one's buffer."""
    flat = {}
    for path, info in gate.index.items():
        w = _leaf_weights(solved, path)
        if w is None:
            flat[path] = fn(path, reader.read_many(gate.accepted, path, info))
            continue
        keep = np.flatnonzero(np.asarray(w))  # zero-weight candidates are never read
        flat[path] = methods.weighted_mean(
            reader.read_many([gate.accepted[i] for i in keep], path, info), np.asarray(w)[keep],
            overwrite_input=True)
    return flat


def merge(candidates: Sequence[Candidate], spec: MergeSpec, out_dir: str | Path,
          evaluator: Any = None, gate_cfg: GateConfig | None = None,
          base: Candidate | None = None, mesh: Any = None, report_evaluator: Any = None) -> dict:
    """Merge candidates into out_dir/checkpoint_<step>; write merge_report.json and the plot.

    `evaluator` holds the selection batches (gate, greedy soup, learned weights);
    `report_evaluator` held-out batches that only the report sees. Without either, the
    merge runs when nothing needs validation (`evaluation_needs`) and reports no loss.
    """
    t0 = time.perf_counter()
    gate_cfg = gate_cfg or GateConfig()
    out_dir = Path(out_dir).absolute()
    if spec.method in ("task_arithmetic", "ties") and base is None:
        raise ValueError(f"method={spec.method} needs a base checkpoint (base=...)")
    needs = evaluation_needs(spec, gate_cfg)
    if needs and evaluator is None:
        raise ValueError(f"{', '.join(needs)} need validation batches (an evaluator)")
    with LeafReader(mesh) as reader:
        gate = run_gate(list(candidates), reader, evaluator, gate_cfg, report_evaluator)
        base_reader = None
        if base is not None:
            base_index = leaf_index(base)
            bad = [p for p in gate.index if p[:1] == ("target",) and p not in base_index]
            if bad:
                raise ValueError(f"base {base.step_dir}: no leaf {'.'.join(bad[0])}")
            base_reader = (reader, base, base_index)
        solved = solve(spec, gate, reader, evaluator, [c.name for c in candidates], base_reader)
        fn = None if "weights" in solved else _leaf_fn(spec, solved, base_reader)
        flat = _merge_leaves(gate, solved, fn, reader)
        step = max(c.step for c in gate.accepted)
        params = unflatten({p[1:]: v for p, v in flat.items() if p[:1] == ("target",)})
        merged_loss = evaluator.loss(params) if evaluator else None
        merged_held_out = report_evaluator.loss(params) if report_evaluator else None
        del params
        ckpt = write(out_dir, step, flat)
    rep = report.build(candidates, spec, gate, solved, (merged_loss, merged_held_out), ckpt,
                       time.perf_counter() - t0)
    (out_dir / REPORT).write_text(json.dumps(rep, indent=1))
    if evaluator is not None:
        report.plot(rep, out_dir / PLOT)
    return rep
