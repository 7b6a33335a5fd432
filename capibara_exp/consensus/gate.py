"""The quality gate: which candidates may enter a merge, and whether enough of them did.

The cheap checks run first (a manifest present, metadata readable, the same tree as the
others); the manifests' digests are checked in threads while the merge streams; NaN/Inf
and the distance to the coordinate-wise median are measured on the leaves the merge's own
streaming read brings in (`Observer`), so a clean merge reads every candidate once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from capibara_exp.base.errors import ConfigError, environment_failure
from capibara_exp.consensus.store import Candidate, LeafInfo, LeafPath, LeafReader, leaf_index
from capibara_exp.runtime import integrity

TARGET: LeafPath = ("target",)


class ConsensusError(RuntimeError):
    """Too few candidates passed the gate for the merge to go ahead."""


def _ratio(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                  and value > 0):
        raise ValueError(f"gate.{name} must be a finite number > 0 or null, got {value!r}")


@dataclasses.dataclass
class Spread:
    """Pairwise squared distances and squared norms of the candidates' parameters,
    accumulated leaf by leaf on the merge's own read."""

    gram: np.ndarray      # centred Gram matrix (methods.gram_update)
    norm_sq: np.ndarray


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Thresholds; None switches a check off."""

    require_manifest: bool = True       # a checkpoint without a checksum manifest is rejected
    check_finite: bool = True           # NaN/Inf anywhere in the tree rejects a candidate
    max_val_loss: float | None = None   # absolute validation-loss ceiling
    max_val_loss_ratio: float | None = 1.5  # ceiling relative to the median candidate's loss
    # Parameter-space outliers: distance to the coordinate-wise median above this x the
    # median such distance (a sign-flipped near-init model can score a normal loss).
    max_distance_ratio: float | None = 4.0
    min_pass_fraction: float = 0.5      # consensus: this share of candidates must pass
    # Soups need fine-tunes of one model (consensus/ancestry.py): candidates must share an
    # ancestor in their manifests' lineage or, without one, lie within this distance of
    # each other relative to their size (independent initialisations: about 1.41).
    require_shared_ancestor: bool = True
    max_relative_distance: float | None = 1.0

    def __post_init__(self) -> None:
        if self.max_val_loss is not None and not (
                isinstance(self.max_val_loss, (int, float)) and math.isfinite(self.max_val_loss)):
            raise ValueError(f"gate.max_val_loss must be a finite number or null, got "
                             f"{self.max_val_loss!r}")
        _ratio("max_val_loss_ratio", self.max_val_loss_ratio)
        _ratio("max_distance_ratio", self.max_distance_ratio)
        _ratio("max_relative_distance", self.max_relative_distance)
        if not isinstance(self.require_shared_ancestor, bool):
            raise ValueError(f"gate.require_shared_ancestor must be true or false, got "
                             f"{self.require_shared_ancestor!r}")
        if not (isinstance(self.min_pass_fraction, (int, float))
                and 0.0 <= self.min_pass_fraction <= 1.0):
            raise ValueError(f"gate.min_pass_fraction must be in [0, 1], got "
                             f"{self.min_pass_fraction!r}")

    def loss_checks(self) -> list[str]:
        """The settings that need validation batches (key=value), [] if none does."""
        return [f"{k}={getattr(self, k)}" for k in ("max_val_loss", "max_val_loss_ratio")
                if getattr(self, k) is not None]


VERIFIED, UNVERIFIED = "verified", "unverified"


@dataclasses.dataclass
class GateResult:
    accepted: list[Candidate]
    rejected: dict[str, str]
    val_loss: dict[str, float]          # on the selection batches (what the gate and solvers see)
    index: dict[LeafPath, LeafInfo]
    integrity: dict[str, str]           # VERIFIED (manifest matched) or UNVERIFIED (no manifest)
    held_out_loss: dict[str, float]     # on the report batches, never used to choose
    gram: np.ndarray | None = None      # the accepted candidates' Gram matrix (Krum, ...)
    pending: dict[str, Future] = dataclasses.field(default_factory=dict)  # digests in flight
    no_lineage: list[str] = dataclasses.field(default_factory=list)  # vouched for by distance
    spread: Any = None                  # Spread of the sound pass, when measured

    def reject(self, candidate: Candidate, why: str) -> None:
        self.rejected.setdefault(candidate.name, why)
        self.accepted = [c for c in self.accepted if c.name != candidate.name]


def _signature(index: dict[LeafPath, LeafInfo]) -> tuple:
    return tuple(sorted((p, i.shape, str(i.dtype)) for p, i in index.items()))


def _structure_diff(index: dict, reference: dict) -> str:
    missing, extra = sorted(set(reference) - set(index)), sorted(set(index) - set(reference))
    if missing or extra:
        names = [("missing " + ".".join(p)) for p in missing[:2]] + [
            ("unexpected " + ".".join(p)) for p in extra[:2]]
        return "structure differs: " + ", ".join(names)
    for p, info in reference.items():
        if (index[p].shape, index[p].dtype) != (info.shape, info.dtype):
            return (f"structure differs: {'.'.join(p)} is {index[p].shape} {index[p].dtype}, "
                    f"others have {info.shape} {info.dtype}")
    return "structure differs"


def _manifest_state(c: Candidate, require_manifest: bool) -> tuple[str, str | None]:
    """(VERIFIED or UNVERIFIED, why it is rejected already or None); digests come later."""
    try:
        manifest = integrity.read_manifest(c.step_dir)
    except ValueError as err:
        return VERIFIED, f"integrity: {err}"
    if manifest is None:
        return UNVERIFIED, ("no checksum manifest, integrity unverified (require_manifest=false "
                            "merges it, marked unverified)" if require_manifest else None)
    return VERIFIED, None


def precheck(candidates: list[Candidate], cfg: GateConfig, pool: ThreadPoolExecutor
             ) -> GateResult:
    """Manifests present, metadata readable, one tree for all; the manifests' digests are
    checked in `pool`'s threads (join them with `settle_digests`)."""
    gate = GateResult(list(candidates), {}, {}, {}, {}, {})
    indexes: dict[str, dict] = {}
    for c in candidates:
        gate.integrity[c.name], reason = _manifest_state(c, cfg.require_manifest)
        if reason is None:
            try:
                indexes[c.name] = leaf_index(c)
            except Exception as err:  # orbax raises many types for unreadable metadata
                if environment_failure(err):  # too many open files: not the candidate's
                    raise
                reason = f"unreadable metadata ({type(err).__name__}: {err})"
        if reason:
            gate.reject(c, reason)
        elif gate.integrity[c.name] == VERIFIED:
            gate.pending[c.name] = pool.submit(integrity.verify_checkpoint, c.step_dir)
    if not indexes:
        fail(candidates, gate.rejected, cfg)
    common, _ = Counter(_signature(i) for i in indexes.values()).most_common(1)[0]
    gate.index = next(i for i in indexes.values() if _signature(i) == common)
    alike = [name for name, i in indexes.items() if _signature(i) == common]
    if len(indexes) > 1 and len(alike) == 1:  # no two of one model: a "merge" of one
        other = next(n for n in indexes if n not in alike)
        raise ConfigError(f"the candidates hold different models ({other}: "
                          f"{_structure_diff(indexes[other], gate.index)}); "
                          "a merge needs at least two checkpoints of one model")
    for c in list(gate.accepted):
        if _signature(indexes[c.name]) != common:
            gate.reject(c, _structure_diff(indexes[c.name], gate.index))
    return gate


def settle_digests(gate: GateResult) -> bool:
    """Join the digest checks; True if one rejected a candidate."""
    by_name = {c.name: c for c in gate.accepted}
    rejected = False
    for name, future in gate.pending.items():
        problems = future.result()
        if problems and name in by_name:
            gate.reject(by_name[name], "integrity: " + "; ".join(problems[:3]))
            rejected = True
    gate.pending.clear()
    return rejected


def digest_pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1)))


def score(gate: GateResult, reader: LeafReader, evaluator: Any, report_evaluator: Any,
          cfg: GateConfig) -> None:
    """Validation losses of the accepted candidates (a read of their parameters each), and the
    loss thresholds."""
    if evaluator is None and report_evaluator is None:
        return
    for c in list(gate.accepted):
        try:
            params = reader.read_subtree(c, gate.index, TARGET)
        except Exception as err:  # a truncated or corrupt store fails in TensorStore
            gate.reject(c, f"unreadable ({type(err).__name__}: {str(err)[:200]})")
            continue
        bad = nonfinite_leaf(params) if cfg.check_finite else None
        if bad:  # said before its loss is: NaN makes an inf loss
            gate.reject(c, f"non-finite values in target.{bad}")
        if evaluator is not None:
            gate.val_loss[c.name] = evaluator.loss(params)
        if report_evaluator is not None:
            gate.held_out_loss[c.name] = report_evaluator.loss(params)
    live = {n: v for n, v in gate.val_loss.items() if n not in gate.rejected}
    if not live:
        return
    ceiling = float("inf")
    if cfg.max_val_loss is not None:
        ceiling = cfg.max_val_loss
    if cfg.max_val_loss_ratio is not None:
        ceiling = min(ceiling, cfg.max_val_loss_ratio * float(np.median(list(live.values()))))
    for c in list(gate.accepted):
        loss = gate.val_loss.get(c.name)
        if loss is not None and not loss <= ceiling:
            gate.reject(c, f"validation loss {loss:.4g} above the gate's ceiling {ceiling:.4g}")


def nonfinite_leaf(params: dict) -> str | None:
    """The dotted path of the first parameter holding NaN/Inf, or None."""
    import jax

    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.issubdtype(np.asarray(leaf).dtype, np.floating) and not np.isfinite(
                np.asarray(leaf)).all():
            return ".".join(str(k.key) for k in path)
    return None


class Observer:
    """The gate's look at the leaves a streaming pass reads: NaN/Inf per candidate (every
    float leaf) and squared distances to the coordinate-wise median (parameters)."""

    def __init__(self, pool: list[Candidate], cfg: GateConfig, spread: Any = None):
        from capibara_exp.consensus import methods

        self._median, self._finite = methods.median, methods.all_finite
        self._sq_distances, self._gram = methods.sq_distances_to, methods.gram_update
        self.spread = spread  # Spread to accumulate, or None
        self.pool = pool
        self.check_finite = cfg.check_finite
        self.ratio = cfg.max_distance_ratio if len(pool) >= 3 else None
        self.dist_sq = np.zeros(len(pool))
        self.bad: dict[int, str] = {}

    def observe(self, path: LeafPath, leaves: list) -> None:
        if self.bad:  # this pass is lost: only look for more bad candidates
            leaves = [x for x in leaves if x is not None]
        floating = bool(leaves) and np.issubdtype(np.asarray(leaves[0]).dtype, np.floating)
        if self.check_finite and floating:
            for i, x in enumerate(leaves):
                if i not in self.bad and not self._finite(x):
                    self.bad[i] = "non-finite values in " + ".".join(path)
        if self.ratio is not None and floating and path[:1] == TARGET and not self.bad:
            self.dist_sq += self._sq_distances(leaves, self._median(leaves))
        if self.spread is not None and floating and path[:1] == TARGET and not self.bad:
            self._gram(self.spread.gram, leaves)
            self.spread.norm_sq += self._sq_distances(leaves, np.zeros_like(leaves[0]))

    def unreadable(self, i: int, err: BaseException) -> None:
        self.bad.setdefault(i, f"unreadable ({type(err).__name__}: {str(err)[:200]})")

    def outliers(self) -> dict[int, str]:
        """Candidates far from the coordinate-wise median (after a pass with no bad ones)."""
        if self.ratio is None:
            return {}
        dist = np.sqrt(self.dist_sq)
        typical = float(np.median(dist))
        return {i: (f"parameters {d:.4g} from the coordinate-wise median, over {self.ratio} x "
                    f"the median distance {typical:.4g}")
                for i, d in enumerate(dist) if typical > 0 and not d <= self.ratio * typical}


def until_sound(candidates: list[Candidate], gate: GateResult, cfg: GateConfig,
                run_pass: Callable[[Observer], Any]) -> Any:
    """Run streaming passes (`run_pass(observer)`, which reads every leaf of the accepted
    candidates once) until one rejects nobody; returns that pass's result. Digest checks
    are joined after the first; distances to the median are measured among the candidates
    that are sound, once."""
    gate_cfg = cfg
    while True:
        enforce(candidates, gate, cfg)
        n = len(gate.accepted)
        spread = Spread(np.zeros((n, n)), np.zeros(n)) if gate.no_lineage else None
        observer = Observer(gate.accepted, gate_cfg, spread)
        result = run_pass(observer)
        pool = list(gate.accepted)
        digests_failed = settle_digests(gate)
        for i, why in observer.bad.items():
            gate.reject(pool[i], why)
        if digests_failed or observer.bad:
            continue  # distances are measured again, among the sound candidates
        outliers = observer.outliers()
        for i, why in outliers.items():
            gate.reject(pool[i], why)
        gate_cfg = dataclasses.replace(cfg, max_distance_ratio=None)
        if not outliers:
            enforce(candidates, gate, cfg)
            gate.spread = spread
            return result


def run_gate(candidates: list[Candidate], reader: LeafReader, evaluator: Any, cfg: GateConfig,
             report_evaluator: Any = None) -> GateResult:
    """The gate on its own (merge() runs the same checks on its own read)."""
    def observe_only(observer: Observer) -> None:
        for path, info in gate.index.items():
            observer.observe(path, read_leaf(reader, gate.accepted, path, info, observer))

    with digest_pool(len(candidates)) as pool:
        gate = precheck(candidates, cfg, pool)
        score(gate, reader, evaluator, report_evaluator, cfg)
        until_sound(candidates, gate, cfg, observe_only)
    return gate


def read_leaf(reader: LeafReader, pool: list[Candidate], path: LeafPath, info: LeafInfo,
              observer: Observer | None) -> list:
    """One leaf of every candidate of the pool; an unreadable one is None (and bad)."""
    try:
        return reader.read_many(pool, path, info)
    except Exception:  # find which: TensorStore raises many types for a damaged store
        if observer is None:
            raise
    leaves = []
    for i, c in enumerate(pool):
        try:
            leaves.append(reader.read(c, path, info))
        except Exception as err:
            observer.unreadable(i, err)
            leaves.append(None)
    return leaves


def enforce(candidates: list[Candidate], gate: GateResult, cfg: GateConfig) -> None:
    """ConsensusError unless enough candidates passed."""
    accepted = len(gate.accepted)
    if accepted < cfg.min_pass_fraction * len(candidates) or not accepted:
        fail(candidates, gate.rejected, cfg)


def fail(candidates: list[Candidate], rejected: dict[str, str], cfg: GateConfig) -> None:
    passed = len(candidates) - len(rejected)
    lines = "; ".join(f"{name}: {why}" for name, why in rejected.items())
    raise ConsensusError(
        f"consensus not reached: {passed} of {len(candidates)} candidates passed the gate, "
        f"min_pass_fraction={cfg.min_pass_fraction} needs "
        f"{max(1, int(np.ceil(cfg.min_pass_fraction * len(candidates))))}; rejected: {lines}")
