"""NumPy reference for segment_stats.pyx."""

import numpy as np


def segment_stats(segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (tokens_per_row, segments_per_row), both int64 [rows]."""
    ids_BxL = np.asarray(segment_ids)
    real_BxL = ids_BxL != 0
    prev_BxL = np.concatenate([np.zeros_like(ids_BxL[:, :1]), ids_BxL[:, :-1]], axis=1)
    starts_BxL = real_BxL & (ids_BxL != prev_BxL)
    return real_BxL.sum(axis=1, dtype=np.int64), starts_BxL.sum(axis=1, dtype=np.int64)
