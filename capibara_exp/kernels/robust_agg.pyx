# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Coordinate-wise robust aggregation of N float32 candidates, NaN-aware.

The inner loops of the Byzantine-robust merges. Columns are processed in blocks of
BLOCK: each candidate's slice is copied into a [P, BLOCK] buffer (P = N rounded up to a
power of two, NaN and padding as +inf, with a count of the real values per column), the
buffer is sorted column-wise by Batcher's odd-even merge network (branch-free min/max
over contiguous rows, 8 lanes with AVX2 where the CPU has it, chosen at import; np.median's
per-column partition is 20x slower here), and the median or trimmed mean is read off each
column. Sums run in float64 in ascending order like the reference, so results match it
bit for bit. Every kernel can write into its first input (out=), so a merge that owns its
read buffers touches no fresh memory. Reference: robust_agg_ref.py.
"""

import numpy as np

cimport numpy as cnp
from libc.math cimport INFINITY, NAN
from libc.stdlib cimport free, malloc

cnp.import_array()

DEF BLOCK = 1024

cdef enum Mode:
    MEDIAN = 0
    TRIMMED = 1


def batcher_pairs(Py_ssize_t p):
    """Compare-exchange pairs (i < j) of Batcher's odd-even merge sort for p = 2^k inputs."""
    pairs = []
    size = 1
    while size < p:
        step = size
        while step >= 1:
            for j in range(step % size, p - step, 2 * step):
                for i in range(min(step, p - j - step)):
                    if (i + j) // (2 * size) == (i + j + step) // (2 * size):
                        pairs.append((i + j, i + j + step))
            step //= 2
        size *= 2
    return np.asarray(pairs, np.intc).reshape(-1, 2)


cdef extern from *:
    """
    #include <math.h>
    /* Row kernels over n columns. Each exists twice on x86: built for the baseline ISA and
       for AVX2 (8 lanes instead of 4), chosen once at import by the CPU's features
       (ra_select_simd), so the extension needs no -march flag and runs on any x86-64.
       No FMA is enabled: products and sums round exactly as in the NumPy reference. */
    /* Compare-exchange of two rows: a = min(a, b), b = max(a, b). The rows hold no NaN
       (NaN is stored as +inf), so min/max are exact. Branch-free: with a scalar select
       GCC kept branches, and random data mispredicts half of them. */
    #define RA_CX_TAIL for (; j < n; j++) { float u = a[j], v = b[j]; a[j] = u < v ? u : v;  \
                                            b[j] = u < v ? v : u; }
    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #define RA_X86 1
    #include <immintrin.h>
    static void ra_cx_base(float* a, float* b, Py_ssize_t n) {
        Py_ssize_t j = 0;
        for (; j + 4 <= n; j += 4) {
            __m128 u = _mm_loadu_ps(a + j), v = _mm_loadu_ps(b + j);
            _mm_storeu_ps(a + j, _mm_min_ps(u, v));
            _mm_storeu_ps(b + j, _mm_max_ps(u, v));
        }
        RA_CX_TAIL
    }
    __attribute__((target("avx2"))) static void ra_cx_avx2(float* a, float* b, Py_ssize_t n) {
        Py_ssize_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 u = _mm256_loadu_ps(a + j), v = _mm256_loadu_ps(b + j);
            _mm256_storeu_ps(a + j, _mm256_min_ps(u, v));
            _mm256_storeu_ps(b + j, _mm256_max_ps(u, v));
        }
        RA_CX_TAIL
    }
    #else
    static void ra_cx_base(float* a, float* b, Py_ssize_t n) { Py_ssize_t j = 0; RA_CX_TAIL }
    #endif
    #define RA_ROW_KERNELS(SUFFIX, ATTR)                                                    \
    /* Copy one candidate's slice into a buffer row, NaN as +inf, counting real values. */ \
    ATTR static void ra_load##SUFFIX(const float* restrict x, float* restrict dst,         \
                                     int* restrict counts, Py_ssize_t n) {                  \
        for (Py_ssize_t j = 0; j < n; j++) {                                                \
            float v = x[j];                                                                 \
            int real = (v == v);                                                            \
            dst[j] = real ? v : INFINITY;                                                   \
            counts[j] += real;                                                              \
        }                                                                                   \
    }                                                                                       \
    /* acc[j] += row[j] in double: sorted rows added one at a time, so every column sums  \
       in ascending order (the reference's order). */                                      \
    ATTR static void ra_add##SUFFIX(const float* restrict row, double* restrict acc,       \
                                    Py_ssize_t n) {                                         \
        for (Py_ssize_t j = 0; j < n; j++) acc[j] += (double)row[j];                        \
    }                                                                                       \
    /* out[j] = (a[j] + b[j]) / 2 in double: the median of NaN-free columns. */            \
    ATTR static void ra_mid##SUFFIX(const float* restrict a, const float* restrict b,      \
                                    float* restrict out, Py_ssize_t n) {                    \
        for (Py_ssize_t j = 0; j < n; j++)                                                  \
            out[j] = (float)(((double)a[j] + (double)b[j]) / 2.0);                          \
    }                                                                                       \
    /* o[j] = o[j] + w * x[j] in float32 (o[j] = w * x[j] when first). */                  \
    ATTR static void ra_axpy##SUFFIX(float* restrict o, const float* restrict x, float w,  \
                                     int first, Py_ssize_t n) {                             \
        if (first) { for (Py_ssize_t j = 0; j < n; j++) o[j] = w * x[j]; }                  \
        else { for (Py_ssize_t j = 0; j < n; j++) o[j] = o[j] + w * x[j]; }                 \
    }

    RA_ROW_KERNELS(_base, )
    static void (*ra_compare_exchange)(float*, float*, Py_ssize_t) = ra_cx_base;
    static void (*ra_load_row)(const float*, float*, int*, Py_ssize_t) = ra_load_base;
    static void (*ra_add_row)(const float*, double*, Py_ssize_t) = ra_add_base;
    static void (*ra_mid_rows)(const float*, const float*, float*, Py_ssize_t) = ra_mid_base;
    static void (*ra_axpy_row)(float*, const float*, float, int, Py_ssize_t) = ra_axpy_base;

    static void ra_use_base(void) {
        ra_compare_exchange = ra_cx_base; ra_load_row = ra_load_base;
        ra_add_row = ra_add_base; ra_mid_rows = ra_mid_base; ra_axpy_row = ra_axpy_base;
    }
    /* The best row kernels this CPU runs, or the baseline ones when allow_avx2 is 0. */
    #ifdef RA_X86
    RA_ROW_KERNELS(_avx2, __attribute__((target("avx2"))))
    static const char* ra_select_simd(int allow_avx2) {
        ra_use_base();
        __builtin_cpu_init();
        if (!allow_avx2 || !__builtin_cpu_supports("avx2")) return "baseline";
        ra_compare_exchange = ra_cx_avx2; ra_load_row = ra_load_avx2;
        ra_add_row = ra_add_avx2; ra_mid_rows = ra_mid_avx2; ra_axpy_row = ra_axpy_avx2;
        return "avx2";
    }
    #else
    static const char* ra_select_simd(int allow_avx2) { ra_use_base(); return "baseline"; }
    #endif
    """
    void ra_compare_exchange(float* a, float* b, Py_ssize_t n) nogil
    void ra_load_row(const float* x, float* dst, int* counts, Py_ssize_t n) nogil
    void ra_add_row(const float* row, double* acc, Py_ssize_t n) nogil
    void ra_mid_rows(const float* a, const float* b, float* out, Py_ssize_t n) nogil
    void ra_axpy_row(float* o, const float* x, float w, int first, Py_ssize_t n) nogil
    const char* ra_select_simd(int allow_avx2)


def select_simd(bint allow_avx2=True):
    """Choose the row kernels: AVX2 where the CPU has it (unless not allowed), else the
    baseline ones; returns the choice. Import chooses the best; tests run both."""
    return ra_select_simd(allow_avx2).decode()


SIMD = select_simd()  # the row kernels' instruction set on this CPU


cdef inline void _sort_block(float* buf, const int* pairs, Py_ssize_t npairs,
                             Py_ssize_t width) noexcept nogil:
    # Branch-free: with scalar `u < v ? u : v` GCC kept branches, and random data
    # mispredicts half of them (0.14 GB/s for 8 candidates; SIMD min/max: see bench).
    cdef Py_ssize_t q
    for q in range(npairs):
        ra_compare_exchange(buf + pairs[2 * q] * BLOCK, buf + pairs[2 * q + 1] * BLOCK, width)


cdef void _core(const float** rows, Py_ssize_t n, Py_ssize_t m, float* out, int mode,
                Py_ssize_t trim, float* buf, int* counts, double* acc, Py_ssize_t p,
                const int* pairs, Py_ssize_t npairs) noexcept nogil:
    cdef Py_ssize_t start, width, i, j, c, k, r, k_all
    cdef bint complete
    cdef double total
    for start in range(0, m, BLOCK):
        width = min(BLOCK, m - start)
        for j in range(width):
            counts[j] = 0
        for i in range(n):
            ra_load_row(rows[i] + start, buf + i * BLOCK, counts, width)
        for i in range(n, p):
            for j in range(width):
                buf[i * BLOCK + j] = INFINITY
        _sort_block(buf, pairs, npairs, width)
        complete = True
        for j in range(width):
            complete = complete and counts[j] == n
        if mode == MEDIAN and complete:  # no NaN in this block: the middle rows
            ra_mid_rows(buf + ((n - 1) // 2) * BLOCK, buf + (n // 2) * BLOCK, out + start, width)
            continue
        if mode == MEDIAN:
            for j in range(width):
                c = counts[j]
                if c == 0:
                    out[start + j] = NAN
                else:
                    out[start + j] = <float> ((<double> buf[((c - 1) // 2) * BLOCK + j]
                                               + <double> buf[(c // 2) * BLOCK + j]) / 2.0)
            continue
        if complete:  # no NaN in this block: add whole sorted rows
            k_all = min(trim, (n - 1) // 2)
            for j in range(width):
                acc[j] = 0.0
            for r in range(k_all, n - k_all):
                ra_add_row(buf + r * BLOCK, acc, width)
            for j in range(width):
                out[start + j] = <float> (acc[j] / (n - 2 * k_all))
            continue
        for j in range(width):
            c = counts[j]
            if c == 0:
                out[start + j] = NAN
                continue
            k = min(trim, (c - 1) // 2)
            total = 0.0
            for r in range(k, c - k):
                total = total + <double> buf[r * BLOCK + j]
            out[start + j] = <float> (total / (c - 2 * k))


def _flat_rows(list arrays, str who):
    """Each array as a contiguous float32 vector (no copy when it already is one)."""
    if not arrays:
        raise ValueError(f"{who}: no candidates")
    flat = [np.ascontiguousarray(a, np.float32).reshape(-1) for a in arrays]
    for f in flat:
        if f.size != flat[0].size:
            raise ValueError(f"{who}: candidates differ in size ({f.size} vs {flat[0].size})")
    return flat


def _output(list flat, out, str who):
    """A fresh float32 vector, or `out` checked: contiguous float32 of the right size, and
    either the first candidate's own buffer (the kernels read each position of every
    candidate before writing it) or memory shared with no candidate."""
    cdef Py_ssize_t m = flat[0].size
    if out is None:
        return np.empty(m, np.float32)
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.size == m
            and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"{who}: out must be a writeable C-contiguous float32 array of "
                         f"{m} elements")
    out_flat = out.reshape(-1)
    for i, f in enumerate(flat):
        if np.may_share_memory(out_flat, f) and not (
                i == 0 and out_flat.__array_interface__["data"][0]
                == f.__array_interface__["data"][0]):
            raise ValueError(f"{who}: out overlaps candidate {i}; it may only be candidate 0 "
                             "itself or memory apart from every candidate")
    return out_flat


def _run(list arrays, int mode, Py_ssize_t trim, out=None):
    cdef Py_ssize_t n = len(arrays), i, p = 1
    flat = _flat_rows(arrays, "robust_agg")
    cdef Py_ssize_t m = flat[0].size
    while p < n:
        p *= 2
    cdef int[:, ::1] pairs = batcher_pairs(p)
    out = _output(flat, out, "robust_agg")
    cdef float[::1] out_v = out
    cdef const float[::1] row_v
    cdef const float** rows = <const float**> malloc(n * sizeof(float*))
    cdef float* buf = <float*> malloc(p * BLOCK * sizeof(float))
    cdef int* counts = <int*> malloc(BLOCK * sizeof(int))
    cdef double* acc = <double*> malloc(BLOCK * sizeof(double))
    cdef const int* pairs_p = &pairs[0, 0] if pairs.shape[0] else NULL
    if rows == NULL or buf == NULL or counts == NULL or acc == NULL:
        free(rows); free(buf); free(counts); free(acc)
        raise MemoryError()
    try:
        for i in range(n):
            row_v = flat[i]
            rows[i] = &row_v[0] if m else NULL
        if m:
            with nogil:
                _core(rows, n, m, &out_v[0], mode, trim, buf, counts, acc, p, pairs_p,
                      pairs.shape[0])
    finally:
        free(rows); free(buf); free(counts); free(acc)
    return out


def nanmedian(x_NxM):
    """Median per column of x [N, M] ignoring NaN (NaN where all are NaN) -> float32 [M]."""
    return _run(list(np.asarray(x_NxM, np.float32)), MEDIAN, 0)


def nan_trimmed_mean(x_NxM, Py_ssize_t trim):
    """Mean per column of the non-NaN values without the `trim` lowest and highest -> [M]."""
    if trim < 0:
        raise ValueError(f"trim must be >= 0, got {trim}")
    return _run(list(np.asarray(x_NxM, np.float32)), TRIMMED, trim)


def nanmedian_of(list arrays, out=None):
    """nanmedian over a list of same-size arrays (no [N, M] stack is built).

    out: where to write the result (flat); it may be arrays[0] itself, so a merge that
    owns its read buffers writes no fresh memory."""
    return _run(arrays, MEDIAN, 0, out)


def nan_trimmed_mean_of(list arrays, Py_ssize_t trim, out=None):
    """nan_trimmed_mean over a list of same-size arrays (out: as for nanmedian_of)."""
    if trim < 0:
        raise ValueError(f"trim must be >= 0, got {trim}")
    return _run(arrays, TRIMMED, trim, out)


def weighted_sum_of(list arrays, weights, out=None):
    """sum_i w_i x_i in float32, accumulated in candidate order per element (cache-blocked).

    out: as for nanmedian_of (arrays[0] itself is safe: each element of it is read once,
    before that element is written)."""
    cdef Py_ssize_t n = len(arrays), i, j, start, width
    if n == 0 or len(weights) != n:
        raise ValueError(f"weighted_sum_of: {n} arrays and {len(weights)} weights")
    flat = _flat_rows(arrays, "weighted_sum_of")
    cdef Py_ssize_t m = flat[0].size
    cdef float[::1] w = np.asarray(weights, np.float32)
    out = _output(flat, out, "weighted_sum_of")  # the first candidate initialises it
    if m == 0:
        return out
    cdef float[::1] out_v = out
    cdef const float[::1] row_v
    cdef const float** rows = <const float**> malloc(n * sizeof(float*))
    if rows == NULL:
        raise MemoryError()
    for i in range(n):
        row_v = flat[i]
        rows[i] = &row_v[0]
    cdef float* o
    try:
        with nogil:
            for start in range(0, m, 4 * BLOCK):  # the output block stays in L1
                width = min(4 * BLOCK, m - start)
                o = &out_v[start]
                for i in range(n):
                    ra_axpy_row(o, rows[i] + start, w[i], i == 0, width)
    finally:
        free(rows)
    return out


def axpy(float[::1] acc_M, const float[::1] x_M, float w):
    """acc += w * x in float32, in place (one pass, no temporary)."""
    if acc_M.shape[0] != x_M.shape[0]:
        raise ValueError(f"axpy: lengths differ ({acc_M.shape[0]} vs {x_M.shape[0]})")
    cdef Py_ssize_t j, m = acc_M.shape[0]
    with nogil:
        for j in range(m):
            acc_M[j] = acc_M[j] + w * x_M[j]
