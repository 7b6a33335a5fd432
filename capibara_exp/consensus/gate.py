"""The quality gate: which candidates may enter a merge, and whether enough of them did."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from capibara_exp.consensus.store import Candidate, LeafInfo, LeafPath, LeafReader, leaf_index
from capibara_exp.runtime import integrity

TARGET: LeafPath = ("target",)


class ConsensusError(RuntimeError):
    """Too few candidates passed the gate for the merge to go ahead."""


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


def _integrity(c: Candidate, require_manifest: bool) -> tuple[str, str | None]:
    """(VERIFIED or UNVERIFIED, the reason to reject or None)."""
    problems = integrity.verify_manifest(c.step_dir)
    if problems is None:
        return UNVERIFIED, ("no checksum manifest, integrity unverified (require_manifest=false "
                            "merges it, marked unverified)" if require_manifest else None)
    return VERIFIED, ("integrity: " + "; ".join(problems[:3]) if problems else None)


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


def _non_finite(reader: LeafReader, c: Candidate, index: dict, params: dict) -> str | None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not bool(np.isfinite(np.asarray(leaf)).all()):
            return "non-finite values in target." + ".".join(str(k.key) for k in path)
    for path, info in index.items():
        if path[:1] != TARGET and np.issubdtype(info.dtype, np.floating):
            if not bool(np.isfinite(np.asarray(reader.read(c, path, info))).all()):
                return "non-finite values in " + ".".join(path)
    return None


def run_gate(candidates: list[Candidate], reader: LeafReader, evaluator: Any,
             cfg: GateConfig, report_evaluator: Any = None) -> GateResult:
    """Check integrity, structure, finiteness and validation loss; enforce the consensus.

    `evaluator` scores the candidates on the selection batches (the loss checks use it);
    `report_evaluator`, when given, scores them on held-out batches for the report only.
    """
    if cfg.loss_checks() and evaluator is None:
        raise ValueError(f"gate {', '.join(cfg.loss_checks())} needs validation batches "
                         "(an evaluator); set it to null to gate without them")
    rejected: dict[str, str] = {}
    indexes: dict[str, dict] = {}
    integrity: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=min(len(candidates), os.cpu_count() or 1) or 1) as pool:
        checked = list(pool.map(lambda c: _integrity(c, cfg.require_manifest), candidates))
    for c, (integrity[c.name], reason) in zip(candidates, checked, strict=True):
        if reason is None:
            try:
                indexes[c.name] = leaf_index(c)
            except Exception as err:  # orbax raises many types for unreadable metadata
                reason = f"unreadable metadata ({type(err).__name__}: {err})"
        if reason:
            rejected[c.name] = reason
    if not indexes:
        _fail(candidates, rejected, cfg)
    common, _ = Counter(_signature(i) for i in indexes.values()).most_common(1)[0]
    reference = next(i for i in indexes.values() if _signature(i) == common)
    val_loss: dict[str, float] = {}
    held_out: dict[str, float] = {}
    for c in candidates:
        if c.name in rejected:
            continue
        if _signature(indexes[c.name]) != common:
            rejected[c.name] = _structure_diff(indexes[c.name], reference)
            continue
        if not (cfg.check_finite or evaluator or report_evaluator):
            continue  # nothing to look at: no read-through (a damaged store fails the merge)
        try:
            params = reader.read_subtree(c, reference, TARGET)
            reason = _non_finite(reader, c, reference, params) if cfg.check_finite else None
        except Exception as err:  # a truncated or corrupt store fails in TensorStore
            reason = f"unreadable ({type(err).__name__}: {str(err)[:200]})"
            params = None
        if params is not None and evaluator is not None:
            val_loss[c.name] = evaluator.loss(params)
        if params is not None and report_evaluator is not None:
            held_out[c.name] = report_evaluator.loss(params)
        if reason:
            rejected[c.name] = reason
    _loss_thresholds(val_loss, rejected, cfg)
    if cfg.max_distance_ratio is not None:
        _distance_outliers([c for c in candidates if c.name not in rejected], reader, reference,
                           rejected, cfg.max_distance_ratio)
    accepted = [c for c in candidates if c.name not in rejected]
    if len(accepted) < cfg.min_pass_fraction * len(candidates) or not accepted:
        _fail(candidates, rejected, cfg)
    return GateResult(accepted, rejected, val_loss, reference, integrity, held_out)


def _loss_thresholds(val_loss: dict[str, float], rejected: dict[str, str], cfg: GateConfig) -> None:
    live = {n: v for n, v in val_loss.items() if n not in rejected}
    if not live:
        return
    ceiling = float("inf")
    if cfg.max_val_loss is not None:
        ceiling = cfg.max_val_loss
    if cfg.max_val_loss_ratio is not None:
        ceiling = min(ceiling, cfg.max_val_loss_ratio * float(np.median(list(live.values()))))
    for name, loss in live.items():
        if not loss <= ceiling:
            rejected[name] = f"validation loss {loss:.4g} above the gate's ceiling {ceiling:.4g}"


def _distance_outliers(live: list[Candidate], reader: LeafReader, index: dict,
                       rejected: dict[str, str], ratio: float) -> None:
    """Reject candidates far from the coordinate-wise median (one streaming pass)."""
    from capibara_exp.consensus import methods

    if len(live) < 3:
        return
    dist_sq = np.zeros(len(live))
    for path, info in index.items():
        if path[:1] != TARGET:
            continue
        leaves = reader.read_many(live, path, info)
        med = np.asarray(methods.median(leaves), np.float32)
        for i, x in enumerate(leaves):
            d = np.subtract(np.asarray(x), med, dtype=np.float32)
            dist_sq[i] += float(np.square(d, out=d).sum(dtype=np.float64))  # pairwise sum
    dist = np.sqrt(dist_sq)
    typical = float(np.median(dist))
    for c, d in zip(live, dist, strict=True):
        if typical > 0 and not d <= ratio * typical:
            rejected[c.name] = (f"parameters {d:.4g} from the coordinate-wise median, over "
                                f"{ratio} x the median distance {typical:.4g}")


def _fail(candidates: list[Candidate], rejected: dict[str, str], cfg: GateConfig) -> None:
    passed = len(candidates) - len(rejected)
    lines = "\n".join(f"  {name}: {why}" for name, why in rejected.items())
    raise ConsensusError(
        f"consensus not reached: {passed} of {len(candidates)} candidates passed the gate, "
        f"min_pass_fraction={cfg.min_pass_fraction} needs "
        f"{int(np.ceil(cfg.min_pass_fraction * len(candidates)))}; rejected:\n{lines}")
