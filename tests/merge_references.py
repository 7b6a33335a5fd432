"""NumPy references of the merge methods, written from the papers' definitions (and
mergekit's documented parameters), element by element, to test the project's versions.

Nothing here calls the project's merge code: each function takes the leaves of the
candidates (and the base) and, where a method draws at random, the uniform draws.
"""

from __future__ import annotations

import math

import numpy as np


def slerp(t: float, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Shoemake's slerp of the directions, its coefficients applied to the raw vectors.

    Geometry instead of the closed form: in the plane of a and b, with e1 = a/|a| and e2
    the unit part of b orthogonal to it, the unit result is cos(t W) e1 + sin(t W) e2 (W
    the angle between them); writing it as alpha a/|a| + beta b/|b| gives the
    coefficients, which then weigh a and b themselves (as model mergers apply it)."""
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    ua, ub = x / np.linalg.norm(x), y / np.linalg.norm(y)
    cos = float(ua @ ub)
    if abs(cos) > 0.9995:
        return ((1 - t) * x + t * y).reshape(a.shape)
    perp = ub - cos * ua
    e2 = perp / np.linalg.norm(perp)
    angle = math.atan2(float(ub @ e2), cos)
    target = math.cos(t * angle) * ua + math.sin(t * angle) * e2
    basis = np.stack([ua, ub], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(basis, target, rcond=None)
    out = alpha * x + beta * y  # the unit directions' coefficients, on the raw vectors
    return out.reshape(a.shape)


def layer_factor(anchors: list[float], layer: int, num_layers: int) -> float:
    """mergekit's gradient: anchors evenly spaced from the first layer to the last."""
    grid = np.linspace(0.0, 1.0, len(anchors))
    return float(np.interp(layer / (num_layers - 1), grid, anchors))


def dare_sparsify(tv: np.ndarray, keep: np.ndarray, density: float) -> np.ndarray:
    """DARE: drop the entries not kept, scale the rest by 1 / (1 - p), p = 1 - density."""
    out = np.zeros_like(tv, dtype=np.float64)
    for i in np.ndindex(tv.shape):
        if keep[i]:
            out[i] = tv[i] / (1.0 - (1.0 - density))
    return out


def breadcrumbs_sparsify(tv: np.ndarray, density: float, gamma: float) -> np.ndarray:
    """Breadcrumbs: rank by magnitude, largest first; the first floor(gamma n) are outliers,
    the next floor(density n) stay, the rest (the smallest) go (fewer outliers when the
    two do not fit)."""
    flat = tv.astype(np.float64).ravel()
    n = flat.size
    keep_n = math.floor(density * n)
    outliers = min(math.floor(gamma * n), n - keep_n)
    ranked = sorted(range(n), key=lambda i: -abs(flat[i]))
    kept = set(ranked[outliers:outliers + keep_n])
    return np.array([flat[i] if i in kept else 0.0 for i in range(n)]).reshape(tv.shape)


def della_sparsify(tv: np.ndarray, density: float, epsilon: float, u: np.ndarray
                   ) -> np.ndarray:
    """DELLA's MAGPRUNE per row (last axis): the r-th smallest magnitude of m is kept with
    probability density - epsilon + 2 epsilon r / (m - 1), and scaled by 1 / that."""
    rows, draws = tv.reshape(-1, tv.shape[-1]).astype(np.float64), u.reshape(-1, tv.shape[-1])
    out = np.zeros_like(rows)
    m = rows.shape[1]
    for k in range(rows.shape[0]):
        order = sorted(range(m), key=lambda j: abs(rows[k, j]))
        for r, j in enumerate(order):
            p = density - epsilon + 2 * epsilon * (r / (m - 1) if m > 1 else 0.5)
            if draws[k, j] < p:
                out[k, j] = rows[k, j] / p
    return out.reshape(tv.shape)


def sign_elect_merge(tvs: list[np.ndarray], weights: list[float], normalize: bool
                     ) -> np.ndarray:
    """TIES' elect and disjoint merge, weighted: the sign of the weighted sum wins (0 counts
    as +), only agreeing entries add up; normalised by the agreeing weight."""
    out = np.zeros_like(tvs[0], dtype=np.float64)
    for i in np.ndindex(out.shape):
        vals = [w * float(t[i]) for w, t in zip(weights, tvs, strict=True)]
        sign = 1.0 if sum(vals) >= 0 else -1.0
        agreeing = [(v, w) for v, w in zip(vals, weights, strict=True) if v != 0 and
                    math.copysign(1.0, v) == sign]
        total = sum(v for v, _ in agreeing)
        weight = sum(w for _, w in agreeing)
        out[i] = total / (weight or 1.0) if normalize else total
    return out


def linear_merge(tvs: list[np.ndarray], weights: list[float], normalize: bool) -> np.ndarray:
    total = sum(w * t.astype(np.float64) for w, t in zip(weights, tvs, strict=True))
    return total / sum(weights) if normalize else total


def model_stock(leaves: list[np.ndarray], base: np.ndarray) -> np.ndarray:
    """Model Stock: t = N cos / (1 + (N - 1) cos), cos the mean pairwise cosine of the
    fine-tuned offsets from the base; w = t mean(w_i) + (1 - t) w_0."""
    offsets = [x.astype(np.float64).ravel() - base.astype(np.float64).ravel() for x in leaves]
    pairs = [(i, j) for i in range(len(offsets)) for j in range(i + 1, len(offsets))]
    cos = np.mean([offsets[i] @ offsets[j] / (np.linalg.norm(offsets[i])
                                              * np.linalg.norm(offsets[j])) for i, j in pairs])
    n = len(leaves)
    t = n * cos / (1 + (n - 1) * cos)
    mean = np.mean([x.astype(np.float64) for x in leaves], axis=0)
    return t * mean + (1 - t) * base.astype(np.float64)
