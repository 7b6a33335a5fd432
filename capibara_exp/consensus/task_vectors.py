"""Sparsified task-vector merges as pure functions of one leaf: DARE, Model Breadcrumbs,
DELLA, and the sign-consensus or linear combination they share (mergekit's generalized
task arithmetic, with its parameter names: `weights`, `density`, `gamma`, `epsilon`,
`normalize`, `rescale`; `scale` is mergekit's `lambda`).

Each method turns a candidate's task vector tv = x - base into a sparser one, then the
task vectors are combined: weighted by `weights`, with TIES' sign election or linearly,
optionally divided by the weight that took part (`normalize`), scaled and added to the
base. The random masks of DARE and DELLA take their uniform draws as an argument
(`uniforms`), so a caller fixes them: merges draw them per candidate and leaf from a seed.

- DARE (Yu et al. 2023, "Language Models are Super Mario"): keep each entry with
  probability `density`, rescale the kept ones by 1 / density.
- Model Breadcrumbs (Davari & Belilovsky 2023): per leaf, drop the `gamma` share of entries
  with the largest magnitude (outliers) and the smallest ones, keeping `density` of them.
- DELLA (Deep et al. 2024, MAGPRUNE): rank magnitudes within each row (the leaf seen as
  [rows, last axis]; a 1-D leaf is one row) and keep an entry with probability from
  density - epsilon (smallest) to density + epsilon (largest), linear in its rank; the kept
  ones are rescaled by 1 / their probability.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np


def uniforms(seed: int, candidate: str, path: Sequence[str], shape: tuple) -> np.ndarray:
    """Uniform [0, 1) draws for one candidate's leaf: fixed by the seed, the candidate's
    name and the leaf's path (not by the candidates' order or which others took part)."""
    key = [seed, zlib.crc32(candidate.encode()), zlib.crc32("/".join(path).encode())]
    return np.random.default_rng(key).random(shape, dtype=np.float32)


def dare(tv: np.ndarray, density: float, u: np.ndarray, rescale: bool = True) -> np.ndarray:
    """DARE's drop-and-rescale: entries with u < density kept (/ density when rescaled)."""
    kept = np.where(u < density, tv, np.float32(0))
    return kept / np.float32(density) if rescale else kept


def breadcrumbs(tv: np.ndarray, density: float, gamma: float) -> np.ndarray:
    """Model Breadcrumbs' mask on one leaf: drop the gamma share of largest magnitudes and
    the smallest ones, so that round-down(density x size) entries stay.

    Largest first; equal magnitudes rank by position (the earlier one counts as larger).
    In linear time: each entry's key is its magnitude's float32 bits above its reversed
    position (unique keys in that order), and one partition finds the two cut keys."""
    n = tv.size
    keep = int(density * n)
    top = min(int(gamma * n), n - keep)  # the outliers give way to reach the density
    if keep == 0:
        return np.zeros_like(tv)
    bits = np.abs(np.asarray(tv, np.float32)).reshape(-1).view(np.uint32).astype(np.uint64)
    key = (bits << np.uint64(32)) | (np.uint64(n - 1) - np.arange(n, dtype=np.uint64))
    low_at, high_at = n - top - keep, n - top - 1  # ascending positions of the kept keys
    cut = np.partition(key, [low_at, high_at])
    mask = (key >= cut[low_at]) & (key <= cut[high_at])
    return np.where(mask.reshape(tv.shape), tv, np.float32(0))


def della_keep_probability(tv: np.ndarray, density: float, epsilon: float) -> np.ndarray:
    """MAGPRUNE's keep probability of each entry: density - epsilon for the smallest
    magnitude of its row up to density + epsilon for the largest, linear in the rank."""
    rows = np.abs(tv).reshape(-1, tv.shape[-1] if tv.ndim else 1)
    order = np.argsort(rows, axis=1, kind="stable")
    ranks = np.empty(rows.shape, np.float32)  # the inverse permutation: each entry's rank
    np.put_along_axis(ranks, order, np.arange(rows.shape[1], dtype=np.float32)[None], axis=1)
    width = rows.shape[1] - 1
    share = ranks / width if width > 0 else np.full_like(ranks, 0.5)
    return (density - epsilon + 2.0 * epsilon * share).astype(np.float32).reshape(tv.shape)


def della(tv: np.ndarray, density: float, epsilon: float, u: np.ndarray,
          rescale: bool = True) -> np.ndarray:
    """DELLA's magnitude-based sampling of one leaf (kept entries / their probability)."""
    p = della_keep_probability(tv, density, epsilon)
    kept = np.where(u < p, tv, np.float32(0))
    return kept / p if rescale else kept


def combine(tvs: Sequence[np.ndarray], weights: Sequence[float], sign_consensus: bool,
            normalize: bool) -> np.ndarray:
    """sum_i w_i tv_i over the entries that agree with the elected sign (TIES: the sign of
    sum_i w_i tv_i, zeros agreeing with neither) or over all (linear); divided by the
    weight that took part at each entry when `normalize` (by 1 where none did)."""
    w = np.asarray(weights, np.float32).reshape((-1,) + (1,) * np.ndim(tvs[0]))
    weighted = np.stack([np.asarray(t, np.float32) for t in tvs]) * w
    if sign_consensus:
        elected = np.where(weighted.sum(axis=0) >= 0, np.float32(1), np.float32(-1))
        agree = np.sign(weighted) == elected
        mixed = np.where(agree, weighted, np.float32(0)).sum(axis=0)
        divisor = np.where(agree, w, np.float32(0)).sum(axis=0)
        divisor = np.where(divisor == 0, np.float32(1), divisor)
    else:
        mixed = weighted.sum(axis=0)
        total = float(w.sum())
        divisor = np.float32(total if abs(total) >= 1e-8 else 1.0)
    return mixed / divisor if normalize else mixed
