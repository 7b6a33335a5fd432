"""pass@k: the unbiased estimator of Chen et al. (2021), per problem from n samples of which
c passed, averaged over problems, with a bootstrap confidence interval over problems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as a product (no huge binomials)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def estimate(counts: Sequence[tuple[int, int]], k: int, seed: int = 0) -> dict[str, float]:
    """{'pass@k', 'pass@k_low', 'pass@k_high'} over problems given (n, c) each; the
    interval is the percentile bootstrap of the mean (fixed seed: the same figures again)."""
    if not counts:
        raise ValueError("pass@k of no problems")
    per = np.asarray([pass_at_k(n, c, k) for n, c in counts])
    rng = np.random.default_rng(seed)
    means = per[rng.integers(0, len(per), (BOOTSTRAP_RESAMPLES, len(per)))].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return {f"pass@{k}": float(per.mean()), f"pass@{k}_low": float(low),
            f"pass@{k}_high": float(high)}
