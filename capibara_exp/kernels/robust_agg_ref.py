"""NumPy reference of kernels/robust_agg.pyx: NaN-aware coordinate-wise robust aggregation.

Over N float32 candidate rows [N, M], per coordinate: NaNs are ignored (a coordinate
where every candidate is NaN gives NaN); sums run in float64 in ascending order of
value and the result is cast to float32, so the kernel matches to the bit.
"""

from __future__ import annotations

import numpy as np


def _sorted_and_counts(x_NxM: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sorted_NxM = np.sort(x_NxM, axis=0)  # NaNs sort last
    return sorted_NxM, np.sum(~np.isnan(x_NxM), axis=0)


def _sum_rows(sorted_NxM: np.ndarray, lo_M: np.ndarray, hi_M: np.ndarray) -> np.ndarray:
    """Sum of sorted rows lo..hi-1 per column, one row at a time (the kernel's order)."""
    acc_M = np.zeros(sorted_NxM.shape[1], np.float64)
    for i, row in enumerate(sorted_NxM):
        keep = (i >= lo_M) & (i < hi_M)
        acc_M = acc_M + np.where(keep, row.astype(np.float64), 0.0)
    return acc_M


def nanmedian(x_NxM: np.ndarray) -> np.ndarray:
    """Median per column ignoring NaN; the mean of the two middle values for an even count."""
    if len(x_NxM) == 0:
        return np.full(x_NxM.shape[1], np.nan, np.float32)
    sorted_NxM, n_M = _sorted_and_counts(x_NxM)
    cols = np.arange(x_NxM.shape[1])
    a_M = sorted_NxM[np.maximum(n_M - 1, 0) // 2, cols].astype(np.float64)
    b_M = sorted_NxM[np.minimum(n_M // 2, len(x_NxM) - 1), cols].astype(np.float64)
    with np.errstate(invalid="ignore"):  # -inf and inf in the middle: NaN, as in the kernel
        out_M = ((a_M + b_M) / 2.0).astype(np.float32)
    out_M[n_M == 0] = np.nan
    return out_M


def nan_trimmed_mean(x_NxM: np.ndarray, trim: int) -> np.ndarray:
    """Mean per column of the non-NaN values without the `trim` lowest and highest.

    Where fewer than 2*trim+1 values are present, trim shrinks to keep at least one.
    """
    if trim < 0:
        raise ValueError(f"trim must be >= 0, got {trim}")
    sorted_NxM, n_M = _sorted_and_counts(x_NxM)
    k_M = np.minimum(trim, np.maximum(n_M - 1, 0) // 2)
    lo_M, hi_M = k_M, n_M - k_M
    with np.errstate(invalid="ignore", divide="ignore"):
        out_M = (_sum_rows(sorted_NxM, lo_M, hi_M) / (hi_M - lo_M)).astype(np.float32)
    out_M[n_M == 0] = np.nan
    return out_M


def axpy(acc_M: np.ndarray, x_M: np.ndarray, w: float) -> None:
    """acc += w * x in float32, in place."""
    acc_M += np.float32(w) * x_M


def weighted_sum_of(arrays: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """sum_i w_i x_i in float32, added in candidate order (the kernel's order)."""
    out = np.zeros(np.asarray(arrays[0]).size, np.float32)
    for x, w in zip(arrays, weights, strict=True):
        out = out + np.float32(w) * np.asarray(x, np.float32).reshape(-1)
    return out
