# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Coordinate-wise robust aggregation of N float32 candidates (rows of x [N, M]), NaN-aware.

The inner loops of the Byzantine-robust merges: per coordinate, gather the non-NaN
values, sort them (insertion sort: N is small, a handful to a few dozen checkpoints)
and take the median or a trimmed mean. Sums run in float64 in ascending order, like
the reference, so results match it bit for bit. Reference: robust_agg_ref.py.
"""

import numpy as np

cimport numpy as cnp
from libc.math cimport NAN, isnan
from libc.stdlib cimport free, malloc

cnp.import_array()


cdef inline Py_ssize_t _gather_sorted(const float[:, ::1] x, Py_ssize_t j, float* buf) noexcept nogil:
    """Non-NaN values of column j into buf, sorted ascending; returns their count."""
    cdef Py_ssize_t n = x.shape[0], i, k, count = 0
    cdef float v
    for i in range(n):
        v = x[i, j]
        if isnan(v):
            continue
        k = count
        while k > 0 and buf[k - 1] > v:
            buf[k] = buf[k - 1]
            k -= 1
        buf[k] = v
        count += 1
    return count


def nanmedian(const float[:, ::1] x_NxM):
    """Median per column ignoring NaN (NaN where all are NaN) -> float32 [M]."""
    cdef Py_ssize_t n = x_NxM.shape[0], m = x_NxM.shape[1], j, count
    out = np.empty(m, np.float32)
    cdef float[::1] out_v = out
    cdef float* buf = <float*> malloc(max(n, 1) * sizeof(float))
    if buf == NULL:
        raise MemoryError()
    try:
        with nogil:
            for j in range(m):
                count = _gather_sorted(x_NxM, j, buf)
                if count == 0:
                    out_v[j] = NAN
                else:
                    out_v[j] = <float> ((<double> buf[(count - 1) // 2] + <double> buf[count // 2]) / 2.0)
    finally:
        free(buf)
    return out


def nan_trimmed_mean(const float[:, ::1] x_NxM, Py_ssize_t trim):
    """Mean per column of the non-NaN values without the `trim` lowest and highest -> [M]."""
    if trim < 0:
        raise ValueError(f"trim must be >= 0, got {trim}")
    cdef Py_ssize_t n = x_NxM.shape[0], m = x_NxM.shape[1], j, i, count, k
    cdef double acc
    out = np.empty(m, np.float32)
    cdef float[::1] out_v = out
    cdef float* buf = <float*> malloc(max(n, 1) * sizeof(float))
    if buf == NULL:
        raise MemoryError()
    try:
        with nogil:
            for j in range(m):
                count = _gather_sorted(x_NxM, j, buf)
                if count == 0:
                    out_v[j] = NAN
                    continue
                k = min(trim, (count - 1) // 2)
                acc = 0.0
                for i in range(k, count - k):
                    acc = acc + <double> buf[i]
                out_v[j] = <float> (acc / (count - 2 * k))
    finally:
        free(buf)
    return out


def axpy(float[::1] acc_M, const float[::1] x_M, float w):
    """acc += w * x in float32, in place (one pass, no temporary)."""
    if acc_M.shape[0] != x_M.shape[0]:
        raise ValueError(f"axpy: lengths differ ({acc_M.shape[0]} vs {x_M.shape[0]})")
    cdef Py_ssize_t j, m = acc_M.shape[0]
    with nogil:
        for j in range(m):
            acc_M[j] = acc_M[j] + w * x_M[j]
