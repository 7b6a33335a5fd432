"""Merge methods as pure functions: per-leaf aggregators and candidate-weight solvers.

Per-leaf aggregators take the same leaf of N candidates and return the merged leaf:
host arrays (np.ndarray, what a single-process merge reads) in, a host array out; or
jax.Arrays with one sharding (possibly over several devices) in, that sharding out, shard
by shard. The coordinate-wise ones run through kernels/robust_agg. With
`overwrite_input=True` the caller hands the leaves over and the result is written into
the first one's buffer (no fresh output memory). Weight solvers (Krum, geometric median)
work on the N x N Gram matrix of the candidates, which one streaming pass accumulates,
so no candidate is ever held whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from capibara_exp.kernels import robust_agg

BLOCK_ELEMENTS = 1 << 15  # Gram pass: columns per matmul block
Leaf = np.ndarray | jax.Array
# fn(parts, out) -> flat float32 result; out is None or a buffer it may write into
HostFn = Callable[[list[np.ndarray], np.ndarray | None], np.ndarray]


def _is_float(x: Leaf) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _reusable(x: np.ndarray) -> np.ndarray | None:
    """x as the kernels' output buffer, when it is one (float32, contiguous, writeable)."""
    ok = x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable and x.size
    return x if ok else None


def _apply(leaves: Sequence[Leaf], fn: HostFn, dtype: np.dtype, overwrite_input: bool) -> Leaf:
    """Apply a host function to host leaves, or to each addressable shard of N
    same-sharded jax.Arrays (the result keeps their sharding)."""
    first = leaves[0]
    if isinstance(first, np.ndarray):
        out = _reusable(first) if overwrite_input else None
        return np.asarray(fn(list(leaves), out)).astype(dtype, copy=False).reshape(first.shape)
    outs = []
    for i, shard in enumerate(first.addressable_shards):
        parts = [np.asarray(leaf.addressable_shards[i].data) for leaf in leaves]
        merged = np.asarray(fn(parts, None)).astype(dtype, copy=False).reshape(parts[0].shape)
        outs.append(jax.device_put(merged, shard.device))
    return jax.make_array_from_single_device_arrays(first.shape, first.sharding, outs)


def _integer_leaf(leaves: Sequence[Leaf]) -> Leaf:
    """Counters (step, optimizer count): the largest, so a resumed run counts on from it."""
    return _apply(leaves, lambda parts, out: np.max(np.stack(parts), axis=0),
                  leaves[0].dtype, False)


def weighted_mean(leaves: Sequence[Leaf], weights: Sequence[float],
                  overwrite_input: bool = False) -> Leaf:
    """sum_i w_i x_i (weights as given; zero-weight candidates are not read, NaN or not)."""
    if not _is_float(leaves[0]):
        return _integer_leaf(leaves)
    used = [(float(w), x) for w, x in zip(weights, leaves, strict=True) if w != 0.0]
    if not used:
        raise ValueError("weighted_mean: every weight is zero")
    ws = [w for w, _ in used]
    return _apply([x for _, x in used],
                  lambda parts, out: robust_agg.weighted_sum_of(parts, ws, out=out),
                  leaves[0].dtype, overwrite_input)


def uniform_weights(n: int) -> np.ndarray:
    return np.full(n, 1.0 / n)


def median(leaves: Sequence[Leaf], overwrite_input: bool = False) -> Leaf:
    """Coordinate-wise median, ignoring NaN."""
    if not _is_float(leaves[0]):
        return _integer_leaf(leaves)
    return _apply(leaves, lambda parts, out: robust_agg.nanmedian_of(parts, out=out),
                  leaves[0].dtype, overwrite_input)


def trimmed_mean(leaves: Sequence[Leaf], trim: int, overwrite_input: bool = False) -> Leaf:
    """Coordinate-wise mean without the `trim` largest and smallest values, ignoring NaN."""
    if not _is_float(leaves[0]):
        return _integer_leaf(leaves)
    return _apply(leaves, lambda parts, out: robust_agg.nan_trimmed_mean_of(parts, trim, out=out),
                  leaves[0].dtype, overwrite_input)


def task_arithmetic(leaves: Sequence[Leaf], base: Leaf, scale: float) -> Leaf:
    """base + scale * sum_i (x_i - base) (Ilharco et al., task vectors)."""
    if not _is_float(base):
        return _integer_leaf(leaves)
    total = sum(x.astype(jnp.float32) - base.astype(jnp.float32) for x in leaves)
    return (base.astype(jnp.float32) + scale * total).astype(base.dtype)


def ties(leaves: Sequence[Leaf], base: Leaf, thresholds_N: Sequence[float], scale: float) -> Leaf:
    """TIES-merging (Yadav et al.) of one leaf: keep the entries of each task vector
    x_i - base whose magnitude reaches that task vector's threshold (over the whole task
    vector: `ties_thresholds`), elect a sign per coordinate by total mass, average the
    agreeing entries."""
    if not _is_float(base):
        return _integer_leaf(leaves)
    xp = np if isinstance(base, np.ndarray) else jnp  # host leaves stay on the host
    base32 = base.astype(np.float32)
    tvs = xp.stack([x.astype(np.float32) - base32 for x in leaves])
    thresh = xp.asarray(thresholds_N, np.float32).reshape((-1,) + (1,) * base32.ndim)
    trimmed = xp.where(xp.abs(tvs) >= thresh, tvs, np.float32(0))
    sign = xp.sign(xp.sum(trimmed, axis=0))
    agree = (xp.sign(trimmed) == sign) & (trimmed != 0)
    count = xp.maximum(xp.sum(agree, axis=0), 1).astype(np.float32)
    merged = xp.sum(xp.where(agree, trimmed, np.float32(0)), axis=0) / count
    return (base32 + np.float32(scale) * merged).astype(base.dtype)


HIST_BINS = 1 << 16


def _magnitude_bits(tv: Leaf) -> np.ndarray:
    """|tv| as float32 bit patterns: for non-negative floats their order is the values'."""
    return np.abs(np.asarray(tv, np.float32)).reshape(-1).view(np.uint32)


def _bin_of_kth_largest(hist_B: np.ndarray, k: int) -> tuple[int, int]:
    """The bin holding the k-th largest value (k from 1) and its rank inside that bin."""
    from_top = np.cumsum(hist_B[::-1])
    j = int(np.searchsorted(from_top, k))
    return len(hist_B) - 1 - j, k - (int(from_top[j - 1]) if j else 0)


def ties_thresholds(task_vectors: Callable[[], Iterable[Sequence[Leaf]]],
                    density: float) -> np.ndarray:
    """Per candidate, the k-th largest magnitude of its task vector over every leaf,
    k = round(density x entries), as TIES trims (not leaf by leaf).

    `task_vectors()` yields, leaf by leaf, the N candidates' x_i - base; it is called
    twice. Exact and streaming: a radix select on float32 bit patterns, first over their
    top 16 bits, then over the low 16 bits inside the chosen bin, so memory stays at two
    65536-bin histograms per candidate and one leaf at a time.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"ties: density must be in (0, 1], got {density}")
    high, total = None, 0
    for tvs in task_vectors():
        if high is None:
            high = np.zeros((len(tvs), HIST_BINS), np.int64)
        for i, tv in enumerate(tvs):
            high[i] += np.bincount(_magnitude_bits(tv) >> 16, minlength=HIST_BINS)
        total += int(np.size(tvs[0]))
    if high is None or total == 0:
        raise ValueError("ties: the candidates have no floating-point parameters")
    k = max(1, int(round(density * total)))
    picks = [_bin_of_kth_largest(h, k) for h in high]
    low = np.zeros_like(high)
    for tvs in task_vectors():
        for i, tv in enumerate(tvs):
            bits = _magnitude_bits(tv)
            low[i] += np.bincount(bits[(bits >> 16) == picks[i][0]] & 0xFFFF,
                                  minlength=HIST_BINS)
    bits = [(hi << 16) | _bin_of_kth_largest(low[i], rank)[0]
            for i, (hi, rank) in enumerate(picks)]
    return np.asarray(bits, np.uint32).view(np.float32)


# ---- weight solvers on the Gram matrix of the candidates ---------------------------------

def _unique_host_parts(leaves: Sequence[Leaf]) -> Iterable[list[np.ndarray]]:
    """Each distinct piece of the leaves once: the whole host arrays, or every shard of
    jax.Arrays that is not a replica of another."""
    if isinstance(leaves[0], np.ndarray):
        yield list(leaves)
        return
    for i, shard in enumerate(leaves[0].addressable_shards):
        if shard.replica_id == 0:
            yield [np.asarray(x.addressable_shards[i].data) for x in leaves]


def gram_update(gram_NxN: np.ndarray, leaves: Sequence[Leaf]) -> None:
    """gram += X X^T for this leaf, X the candidates minus the first one (float64, in place).

    Centring on one candidate keeps the distances exact where candidates are close;
    a non-finite candidate's row and column become NaN.
    """
    if not _is_float(leaves[0]):
        return
    for host in _unique_host_parts(leaves):
        parts = [np.asarray(x).reshape(-1) for x in host]
        for start in range(0, parts[0].size, BLOCK_ELEMENTS):  # float64 a block at a time
            block = np.stack([p[start:start + BLOCK_ELEMENTS] for p in parts], dtype=np.float64)
            block -= block[0]
            with np.errstate(invalid="ignore", over="ignore"):
                gram_NxN += block @ block.T


def sq_distances_to(leaves: Sequence[Leaf], center: Leaf) -> np.ndarray:
    """||x_i - center||^2 for each leaf, float64, a cache-sized block at a time (no
    leaf-sized temporaries; differences, not norms, so close candidates lose nothing)."""
    out = np.zeros(len(leaves))
    c = np.asarray(center, np.float32).reshape(-1)
    flat = [np.asarray(x).reshape(-1) for x in leaves]
    buf = np.empty(min(BLOCK_ELEMENTS, c.size), np.float32)
    for start in range(0, c.size, BLOCK_ELEMENTS):
        stop = min(start + BLOCK_ELEMENTS, c.size)
        d = buf[: stop - start]
        for i, x in enumerate(flat):
            np.subtract(x[start:stop], c[start:stop], out=d, casting="unsafe")
            out[i] += float(np.dot(d, d))
    return out


def all_finite(x: Leaf) -> bool:
    """Whether a leaf holds no NaN/Inf: one summing pass (NaN and Inf survive a sum); only a
    sum that overflows from huge finite values takes the exact look."""
    flat = np.asarray(x).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is looked at next
        if np.isfinite(np.add.reduce(flat)):
            return True
    return bool(np.isfinite(flat).all())


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
