# cython: boundscheck=False, wraparound=False, cdivision=True
"""Per-row statistics of packed batches: real tokens and segments per row.

The runtime counts real (non-padding) tokens for tokens/s and packing fill from these.
Reference: segment_stats_ref.py (same function in NumPy).
"""

import numpy as np

cimport numpy as cnp

cnp.import_array()


def segment_stats(const cnp.int32_t[:, ::1] segment_ids):
    """Return (tokens_per_row, segments_per_row), both int64 [rows].

    A token is real where its segment id is non-zero; a segment starts where the id
    changes to a non-zero value.
    """
    cdef Py_ssize_t rows = segment_ids.shape[0]
    cdef Py_ssize_t length = segment_ids.shape[1]
    tokens = np.zeros(rows, dtype=np.int64)
    segments = np.zeros(rows, dtype=np.int64)
    cdef cnp.int64_t[::1] tokens_v = tokens
    cdef cnp.int64_t[::1] segments_v = segments
    cdef Py_ssize_t r, i
    cdef cnp.int32_t prev, cur
    cdef cnp.int64_t n_tok, n_seg
    with nogil:
        for r in range(rows):
            prev = 0
            n_tok = 0
            n_seg = 0
            for i in range(length):
                cur = segment_ids[r, i]
                if cur != 0:
                    n_tok += 1
                    if cur != prev:
                        n_seg += 1
                prev = cur
            tokens_v[r] = n_tok
            segments_v[r] = n_seg
    return tokens, segments
