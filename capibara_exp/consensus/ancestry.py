"""Whether the candidates of a soup share an ancestor.

Averaging weights only makes sense for models fine-tuned from one base (model soups,
task arithmetic, ...): two models trained from different initialisations sit in
unrelated basins, and their mean is worse than either. The manifests' lineage
(runtime/lineage.py) says where each candidate's weights come from; where a candidate has
none (a checkpoint T5X or another tool wrote), the distance between the candidates'
parameters, relative to their size, stands in: fine-tunes of one base are close, while
independently initialised models are about sqrt(2) apart (their weights nearly
orthogonal). Methods meant for replicas that may be anything (the robust aggregators)
and FedAvg skip the check.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from capibara_exp.composing.merge_methods import METHODS, MergeSpec
from capibara_exp.consensus.gate import ConsensusError, GateConfig, Spread
from capibara_exp.consensus.store import Candidate
from capibara_exp.runtime import lineage

ADVICE = ("a soup averages fine-tunes of one model; for replicas that may be anything use a "
          "robust method (median, trimmed_mean, krum, geometric_median), or set "
          "gate.require_shared_ancestor=false to merge them anyway")


class UnrelatedCandidates(ConsensusError):
    """The candidates of a soup share no ancestor."""


def needed(spec: MergeSpec, cfg: GateConfig) -> bool:
    return METHODS[spec.method].shared_ancestor and cfg.require_shared_ancestor


def check_lineage(candidates: Sequence[Candidate], spec: MergeSpec, cfg: GateConfig
                  ) -> list[Candidate]:
    """UnrelatedCandidates when candidates with recorded lineages share no ancestor; the
    candidates without one, whose distances must then vouch for them."""
    if not needed(spec, cfg):
        return []
    lineages = {c.name: lineage.of_checkpoint(c.step_dir) for c in candidates}
    known = {n: lin for n, lin in lineages.items() if lin}
    if len(known) >= 2 and not lineage.shared(list(known.values())):
        groups: dict[str, list[str]] = {}
        for name, lin in known.items():
            groups.setdefault(lin[-1]["from"], []).append(name)
        said = "; ".join(f"{', '.join(names)} from {origin}" for origin, names in groups.items())
        raise UnrelatedCandidates(f"method={spec.method}: the candidates share no ancestor "
                                  f"({said}): {ADVICE}")
    return [c for c in candidates if not lineages[c.name]]


def shared_ancestors(candidates: Sequence[Candidate]) -> list[dict]:
    """The ancestors all candidates record (a merge's output descends from them)."""
    lineages = [lineage.of_checkpoint(c.step_dir) for c in candidates]
    return lineage.shared(lineages) if lineages and all(lineages) else []


def relative_distances(spread: Spread) -> np.ndarray:
    """||x_i - x_j|| / sqrt((||x_i||^2 + ||x_j||^2) / 2): 0 for equal weights, about
    sqrt(2) for independent ones of one scale."""
    diag = np.diag(spread.gram)
    d_sq = np.maximum(diag[:, None] + diag[None, :] - 2.0 * spread.gram, 0.0)
    scale = (spread.norm_sq[:, None] + spread.norm_sq[None, :]) / 2.0
    return np.sqrt(d_sq / np.maximum(scale, 1e-30))


def check_spread(pool: Sequence[Candidate], unknown: Sequence[str], spread: Spread,
                 spec: MergeSpec, cfg: GateConfig) -> dict[str, float]:
    """Each pair with a candidate of no recorded lineage must be closer than
    cfg.max_relative_distance; UnrelatedCandidates naming the farthest pair otherwise.
    Returns the relative distance of each such candidate to its nearest other one."""
    if cfg.max_relative_distance is None or len(pool) < 2:
        return {}
    rel = relative_distances(spread)
    names = [c.name for c in pool]
    worst, nearest = (0.0, None), {}
    for i, a in enumerate(names):
        if a not in unknown:
            continue
        others = [rel[i, j] for j in range(len(names)) if j != i]
        nearest[a] = float(min(others))
        for j, b in enumerate(names):
            if j != i and rel[i, j] > worst[0]:
                worst = (float(rel[i, j]), (a, b))
    if worst[1] and worst[0] > cfg.max_relative_distance:
        a, b = worst[1]
        raise UnrelatedCandidates(
            f"method={spec.method}: {a} and {b} do not look like fine-tunes of one model: "
            f"their parameters are {worst[0]:.3g} apart relative to their size (over "
            f"gate.max_relative_distance={cfg.max_relative_distance}; independently "
            f"initialised models measure about 1.41), and {a} records no lineage: {ADVICE}")
    return nearest
