"""The merge: gate the candidates, solve the method, stream every leaf, check, write, report.

`merge()` is the one entry point the action, the Hydra callback, the console script and
the federated rounds share. The gate's checks ride on the merge's own streaming read: one
pass reads each leaf of every candidate once, checks it (NaN/Inf, distance to the median),
and for methods whose weights are known up front merges it in the same pass; only a
rejected candidate costs another pass. The merged state is checked like an input (the
candidates' tree, every value finite) before it is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capibara_exp.composing.merge_methods import MergeSpec
from capibara_exp.consensus import ancestry, merge_report, methods
from capibara_exp.consensus import gate as gating
from capibara_exp.consensus.gate import ConsensusError, GateConfig, GateResult, Observer
from capibara_exp.consensus.registry import METHODS, Solve
from capibara_exp.consensus.store import Candidate, LeafReader, leaf_index, unflatten, write

REPORT = "merge_report.json"
PLOT = "merge_metrics.png"
TARGET = ("target",)


def evaluation_needs(spec: MergeSpec, gate: GateConfig) -> list[str]:
    """The settings (key=value) that need validation batches; [] when none does."""
    return ([f"method={spec.method}"] if METHODS[spec.method].needs_validation else []) + [
        f"gate.{check}" for check in gate.loss_checks()]


def _check_request(candidates: list[Candidate], spec: MergeSpec, gate_cfg: GateConfig,
                   evaluator: Any, base: Candidate | None) -> None:
    if not candidates:
        raise ValueError("runs: no candidates to merge (give at least one model dir or "
                         "checkpoint_<step> dir)")
    spec.check_candidates(len(candidates))
    if METHODS[spec.method].needs_base and base is None:
        raise ValueError(f"method={spec.method} needs a base checkpoint (base=...)")
    needs = evaluation_needs(spec, gate_cfg)
    if needs and evaluator is None:
        raise ValueError(f"{', '.join(needs)} need validation batches (an evaluator)")


def _leaf_weights(solved: dict, path: tuple) -> np.ndarray | None:
    """This leaf's weights: per layer for `learned` parameters; the optimizer state of
    `learned` takes each candidate's mean layer weight."""
    if "layer_weights" in solved and path in solved["group_of"]:
        return solved["layer_weights"][:, solved["group_of"][path]]
    w = solved.get("weights")
    return None if w is None else np.asarray(w)


def _stream(gate: GateResult, reader: LeafReader, observer: Observer | None, solved: dict,
            fn: Any) -> dict | None:
    """One read of every leaf of the accepted candidates: the observer sees each leaf, the
    Gram matrix accumulates, and the leaf is merged (per-leaf `fn`, or the solved weights).
    None when the observer found a bad candidate (the merge must run again without it).
    The leaves are fresh reads this pass owns, so the aggregators write into the first."""
    pool, flat = gate.accepted, {}
    merging = fn is not None or "weights" in solved
    for path, info in gate.index.items():
        w = _leaf_weights(solved, path)
        if observer is None and w is not None:  # zero-weight candidates are never read
            keep = np.flatnonzero(w)
            flat[path] = methods.weighted_mean(reader.read_many(
                [pool[i] for i in keep], path, info), w[keep], overwrite_input=True)
            continue
        leaves = gating.read_leaf(reader, pool, path, info, observer)
        if observer is not None:
            observer.observe(path, leaves)
            if observer.bad:
                merging = False
                continue
        if gate.gram is not None and path[:1] == TARGET:
            methods.gram_update(gate.gram, leaves)
        if fn is not None:
            flat[path] = fn(path, leaves)
        elif w is not None:
            flat[path] = methods.weighted_mean(leaves, w, overwrite_input=True)
    return flat if merging else None


# Methods whose weights depend only on which candidates are in the pool: they merge in the
# gate's pass. Per-leaf methods without a solver do too.
UP_FRONT = ("uniform", "weighted")


def _gated_merge(gate: GateResult, candidates: list[Candidate], spec: MergeSpec,
                 cfg: GateConfig, solve: Solve) -> tuple[dict, dict]:
    """Stream, gating and (where it can) merging in the same pass, until no candidate is
    rejected; then solve the method and merge, if that pass could not. (flat, solved)."""
    method = METHODS[spec.method]
    in_gate_pass = spec.method in UP_FRONT or (method.leaf is not None and method.solve is None)
    solved: dict = {}

    def gate_pass(observer: Observer) -> dict | None:
        _check_passed(gate, spec)
        solved.clear()
        solved.update(method.solve(solve) if spec.method in UP_FRONT else {})
        fn = method.leaf(spec, {}, solve.base) if in_gate_pass and method.leaf else None
        gate.gram = np.zeros((len(gate.accepted),) * 2) if method.needs_gram else None
        return _stream(gate, solve.reader, observer, solved, fn)

    flat = gating.until_sound(candidates, gate, cfg, gate_pass)
    _check_passed(gate, spec)
    if gate.spread is not None:
        solved["nearest_relative_distance"] = ancestry.check_spread(
            gate.accepted, gate.no_lineage, gate.spread, spec, cfg)
    if flat is None:
        solved.update(method.solve(solve) if method.solve else {})
        fn = method.leaf(spec, solved, solve.base) if method.leaf else None
        flat = _stream(gate, solve.reader, None, solved, fn)
    return flat, solved


def _check_passed(gate: GateResult, spec: MergeSpec) -> None:
    """The method's bounds on the candidates left (e.g. Krum's n > 2f + 2) as errors."""
    try:
        spec.check_candidates(len(gate.accepted), "candidates that passed the gate")
    except ValueError as err:
        lines = "; ".join(f"{name}: {why}" for name, why in gate.rejected.items())
        raise ConsensusError(f"{err}; rejected: {lines or 'none'}") from None


def check_output(flat: dict, gate: GateResult, spec: MergeSpec) -> None:
    """The merged state has the candidates' tree and only finite values, or nothing is
    written."""
    want, have = set(gate.index), set(flat)
    if want != have:
        odd = sorted(want ^ have)[0]
        raise ValueError(f"merged state not written (method={spec.method}): its tree differs "
                         f"from the candidates' at {'.'.join(odd)}")
    for path, info in gate.index.items():
        leaf = np.asarray(flat[path])
        if tuple(leaf.shape) != tuple(info.shape) or leaf.dtype != info.dtype:
            raise ValueError(f"merged state not written (method={spec.method}): "
                             f"{'.'.join(path)} is {leaf.shape} {leaf.dtype}, the candidates' "
                             f"is {info.shape} {info.dtype}")
        if np.issubdtype(leaf.dtype, np.floating) and not np.isfinite(leaf).all():
            raise ValueError(f"merged state not written: method={spec.method} gave non-finite "
                             f"values in {'.'.join(path)} (parameters {_params(spec)})")


def _params(spec: MergeSpec) -> str:
    used = METHODS[spec.method].params
    return ", ".join(f"{k}={getattr(spec, k)!r}" for k in used) or "none"


def merge(candidates: Sequence[Candidate], spec: MergeSpec, out_dir: str | Path,
          evaluator: Any = None, gate_cfg: GateConfig | None = None,
          base: Candidate | None = None, mesh: Any = None, report_evaluator: Any = None) -> dict:
    """Merge candidates into out_dir/checkpoint_<step>; write merge_report.json and the plot.

    `evaluator` holds the selection batches (gate, greedy soup, learned weights);
    `report_evaluator` held-out batches that only the report sees. Without either, the
    merge runs when nothing needs validation (`evaluation_needs`) and reports no loss.
    """
    t0 = time.perf_counter()
    candidates, gate_cfg = list(candidates), gate_cfg or GateConfig()
    _check_request(candidates, spec, gate_cfg, evaluator, base)
    out_dir = Path(out_dir).absolute()
    with LeafReader(mesh) as reader, gating.digest_pool(len(candidates)) as pool:
        gate = gating.precheck(candidates, gate_cfg, pool)
        gate.no_lineage = [c.name for c in ancestry.check_lineage(gate.accepted, spec, gate_cfg)]
        gating.score(gate, reader, evaluator, report_evaluator, gate_cfg)
        base_reader = _base_reader(base, reader, gate) if base is not None else None
        flat, solved = _gated_merge(gate, candidates, spec, gate_cfg, Solve(
            spec, gate, reader, evaluator, [c.name for c in candidates], base_reader))
        check_output(flat, gate, spec)
        step = max(c.step for c in gate.accepted)
        params = unflatten({p[1:]: v for p, v in flat.items() if p[:1] == TARGET})
        merged_loss = evaluator.loss(params) if evaluator else None
        merged_held_out = report_evaluator.loss(params) if report_evaluator else None
        del params
        ckpt = write(out_dir, step, _with_ema_copy(flat, gate),
                     lineage=ancestry.shared_ancestors(gate.accepted))
    rep = merge_report.build(candidates, spec, gate, solved, (merged_loss, merged_held_out), ckpt,
                       time.perf_counter() - t0)
    (out_dir / REPORT).write_text(json.dumps(rep, indent=1))
    if evaluator is not None:
        merge_report.plot(rep, out_dir / PLOT)
    return rep


def _with_ema_copy(flat: dict, gate: GateResult) -> dict:
    """Merged EMA runs give a checkpoint an EMA run resumes from: its EMA weights start at
    the merged ones."""
    if not all(c.params_item == "ema_target" for c in gate.accepted):
        return flat
    return flat | {("ema_target", *p[1:]): np.array(v) for p, v in flat.items()
                   if p[:1] == TARGET}


def _base_reader(base: Candidate, reader: LeafReader, gate: GateResult) -> tuple:
    base_index = leaf_index(base)
    bad = [p for p in gate.index if p[:1] == TARGET and p not in base_index]
    if bad:
        raise ValueError(f"base {base.step_dir}: no leaf {'.'.join(bad[0])}")
    return reader, base, base_index
