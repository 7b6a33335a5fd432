"""Merge methods as pure functions: per-leaf aggregators and candidate-weight solvers.

Per-leaf aggregators take the same leaf of N candidates (jax.Arrays with one sharding,
possibly over several devices) and return the merged leaf with that sharding; the
coordinate-wise ones run shard by shard through kernels/robust_agg. Weight solvers
(Krum, geometric median) work on the N x N Gram matrix of the candidates, which one
streaming pass accumulates, so no candidate is ever held whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from capibara_exp.kernels import robust_agg

BLOCK_ELEMENTS = 1 << 15  # Gram pass: columns per matmul block


def _is_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _shardwise(leaves: Sequence[jax.Array], fn: Callable[[list[np.ndarray]], np.ndarray]
               ) -> jax.Array:
    """Apply a host function to each addressable shard of N same-sharded arrays."""
    first = leaves[0]
    outs = []
    for i, shard in enumerate(first.addressable_shards):
        parts = [np.asarray(leaf.addressable_shards[i].data) for leaf in leaves]
        outs.append(jax.device_put(fn(parts).reshape(parts[0].shape), shard.device))
    return jax.make_array_from_single_device_arrays(first.shape, first.sharding, outs)


def _integer_leaf(leaves: Sequence[jax.Array]) -> jax.Array:
    """Counters (step, optimizer count): the largest, so a resumed run counts on from it."""
    return _shardwise(leaves, lambda parts: np.max(np.stack(parts), axis=0))


def weighted_mean(leaves: Sequence[jax.Array], weights: Sequence[float]) -> jax.Array:
    """sum_i w_i x_i (weights as given; zero-weight candidates are not read, NaN or not)."""
    if not _is_float(leaves[0]):
        return _integer_leaf(leaves)
    used = [(float(w), x) for w, x in zip(weights, leaves, strict=True) if w != 0.0]
    if not used:
        raise ValueError("weighted_mean: every weight is zero")
    dtype = leaves[0].dtype

    ws = [w for w, _ in used]
    return _shardwise([x for _, x in used],
                      lambda parts: robust_agg.weighted_sum_of(parts, ws).astype(dtype, copy=False))


def uniform_weights(n: int) -> np.ndarray:
    return np.full(n, 1.0 / n)


def median(leaves: Sequence[jax.Array]) -> jax.Array:
    """Coordinate-wise median, ignoring NaN."""
    if not _is_float(leaves[0]):
        return _integer_leaf(leaves)
    dtype = leaves[0].dtype
    return _shardwise(leaves,
                      lambda parts: robust_agg.nanmedian_of(parts).astype(dtype, copy=False))


def trimmed_mean(leaves: Sequence[jax.Array], trim: int) -> jax.Array:
    """Coordinate-wise mean without the `trim` largest and smallest values, ignoring NaN."""
    if not _is_float(leaves[0]):
        return _integer_leaf(leaves)
    dtype = leaves[0].dtype
    return _shardwise(leaves, lambda parts: robust_agg.nan_trimmed_mean_of(parts, trim).astype(
        dtype, copy=False))


def task_arithmetic(leaves: Sequence[jax.Array], base: jax.Array, scale: float) -> jax.Array:
    """base + scale * sum_i (x_i - base) (Ilharco et al., task vectors)."""
    if not _is_float(base):
        return _integer_leaf(leaves)
    total = sum(x.astype(jnp.float32) - base.astype(jnp.float32) for x in leaves)
    return (base.astype(jnp.float32) + scale * total).astype(base.dtype)


def ties(leaves: Sequence[jax.Array], base: jax.Array, density: float, scale: float) -> jax.Array:
    """TIES-merging (Yadav et al.): trim each task vector to its top `density` by magnitude,
    elect a sign per coordinate by total mass, average the agreeing entries."""
    if not _is_float(base):
        return _integer_leaf(leaves)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"ties: density must be in (0, 1], got {density}")
    base32 = base.astype(jnp.float32)
    tvs = jnp.stack([x.astype(jnp.float32) - base32 for x in leaves])
    mags = jnp.abs(tvs).reshape(len(leaves), -1)
    keep = max(1, int(round(density * mags.shape[1])))
    thresh = -jnp.sort(-mags, axis=1)[:, keep - 1]
    trimmed = jnp.where(jnp.abs(tvs) >= thresh.reshape((-1,) + (1,) * base.ndim), tvs, 0.0)
    sign = jnp.sign(jnp.sum(trimmed, axis=0))
    agree = (jnp.sign(trimmed) == sign) & (trimmed != 0)
    count = jnp.maximum(jnp.sum(agree, axis=0), 1)
    merged = jnp.sum(jnp.where(agree, trimmed, 0.0), axis=0) / count
    return (base32 + scale * merged).astype(base.dtype)


# ---- weight solvers on the Gram matrix of the candidates ---------------------------------

def gram_update(gram_NxN: np.ndarray, leaves: Sequence[jax.Array]) -> None:
    """gram += X X^T for this leaf, X the candidates minus the first one (float64, in place).

    Centring on one candidate keeps the distances exact where candidates are close;
    a non-finite candidate's row and column become NaN.
    """
    if not _is_float(leaves[0]):
        return
    for i, shard in enumerate(leaves[0].addressable_shards):
        if shard.replica_id != 0:
            continue
        parts = [np.asarray(x.addressable_shards[i].data, np.float64).reshape(-1) for x in leaves]
        for start in range(0, parts[0].size, BLOCK_ELEMENTS):
            block = np.stack([p[start:start + BLOCK_ELEMENTS] for p in parts])
            block -= block[0]
            with np.errstate(invalid="ignore", over="ignore"):
                gram_NxN += block @ block.T


def distances_sq(gram_NxN: np.ndarray) -> np.ndarray:
    """Pairwise squared distances from a Gram matrix; inf for non-finite candidates."""
    diag = np.diag(gram_NxN)
    d = diag[:, None] + diag[None, :] - 2.0 * gram_NxN
    d = np.maximum(d, 0.0)
    bad = ~np.isfinite(diag)
    d[bad, :] = np.inf
    d[:, bad] = np.inf
    np.fill_diagonal(d, 0.0)
    return d


def krum_weights(gram_NxN: np.ndarray, num_byzantine: int, num_selected: int = 1) -> np.ndarray:
    """(Multi-)Krum (Blanchard et al.): average the `num_selected` candidates whose n-f-2
    nearest neighbours are closest."""
    n = len(gram_NxN)
    if n - num_byzantine - 2 < 1:
        raise ValueError(f"krum: needs n - f - 2 >= 1 (n={n} candidates, f={num_byzantine})")
    if not 1 <= num_selected <= n - num_byzantine:
        raise ValueError(f"krum: num_selected must be in [1, n - f] = [1, {n - num_byzantine}], "
                         f"got {num_selected}")
    d = distances_sq(gram_NxN)
    np.fill_diagonal(d, np.inf)
    scores = np.sort(d, axis=1)[:, : n - num_byzantine - 2].sum(axis=1)
    chosen = np.argsort(scores, kind="stable")[:num_selected]
    weights = np.zeros(n)
    weights[chosen] = 1.0 / num_selected
    return weights


def geometric_median_weights(gram_NxN: np.ndarray, iters: int = 100, tol: float = 1e-10,
                             eps: float = 1e-12) -> np.ndarray:
    """Weiszfeld's iteration for the geometric median z = sum_i w_i x_i, on the Gram matrix."""
    finite = np.isfinite(np.diag(gram_NxN))
    g = np.where(np.outer(finite, finite), gram_NxN, 0.0)
    w = finite / finite.sum()
    for _ in range(iters):
        gw = g @ w
        d = np.sqrt(np.maximum(np.diag(g) - 2.0 * gw + w @ gw, 0.0))
        inv = np.where(finite, 1.0 / np.maximum(d, eps), 0.0)
        new = inv / inv.sum()
        if np.abs(new - w).sum() < tol:
            return new
        w = new
    return w
