# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Greedy packing of variable-length examples into fixed-length rows, in seqio's format.

Same functions, arguments and outputs as packing_ref.py (read its docstring for the exact
semantics): `pack_first_fit` (the better fill) and `pack_next_fit` (seqio bit for bit).

Writing the outputs is most of the time, so each kernel is one pass without the GIL that
writes every slot once: examples go straight to their row, and a row's padding is zeroed
when the row closes. The outputs are allocated for a proven upper bound on the row count
(pages never written are never faulted in) and shrunk in place at the end.
"""

import numpy as np

cimport numpy as cnp
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from capibara_exp.kernels.packing_ref import validate

cnp.import_array()

ctypedef cnp.int32_t i32
ctypedef cnp.int64_t i64


cdef struct Out:
    i32 *targets
    i32 *segment_ids
    i32 *positions
    const i32 *iota  # 0, 1, ..., length - 1
    Py_ssize_t length


cdef inline void put(Out *out, i64 row, i32 offset, const i32 *example, i32 n,
                     i32 segment, bint zero_is_padding) noexcept nogil:
    """Write one example of n tokens at (row, offset) with this segment id."""
    cdef i64 at = row * out.length + offset
    cdef i32 *segments = out.segment_ids + at
    cdef i32 j
    memcpy(out.targets + at, example, n * sizeof(i32))
    memcpy(out.positions + at, out.iota, n * sizeof(i32))
    if zero_is_padding:  # seqio masks segment ids wherever the token is 0
        for j in range(n):
            segments[j] = segment * (example[j] != 0)
    else:
        for j in range(n):
            segments[j] = segment


cdef inline void pad(Out *out, i64 row, i32 fill) noexcept nogil:
    """Zero the slots of a closed row from `fill` on."""
    cdef i64 at = row * out.length + fill
    cdef size_t size = (out.length - fill) * sizeof(i32)
    memset(out.targets + at, 0, size)
    memset(out.segment_ids + at, 0, size)
    memset(out.positions + at, 0, size)


cdef tuple allocate(Out *out, i64 max_rows, Py_ssize_t length):
    arrays = tuple(np.empty((max_rows, length), np.int32) for _ in range(3))
    iota = np.arange(length, dtype=np.int32)
    out.targets = <i32 *> cnp.PyArray_DATA(arrays[0])
    out.segment_ids = <i32 *> cnp.PyArray_DATA(arrays[1])
    out.positions = <i32 *> cnp.PyArray_DATA(arrays[2])
    out.iota = <const i32 *> cnp.PyArray_DATA(iota)
    out.length = length
    return arrays + (iota,)


cdef tuple shrink(tuple arrays, i64 rows, Py_ssize_t length):
    """The first `rows` rows of each output, in place (realloc; no copy of large arrays)."""
    for array in arrays[:3]:
        array.resize((rows, length), refcheck=False)
    return arrays[:3]


def pack_first_fit(tokens, lengths, Py_ssize_t length, Py_ssize_t max_open_rows=64):
    """First-fit packing over a window of at most `max_open_rows` open rows."""
    tokens, lengths = validate(tokens, lengths, length, max_open_rows, "max_open_rows")
    cdef const i32[::1] tokens_v = tokens
    cdef const i64[::1] lengths_v = lengths
    cdef Py_ssize_t n_examples = lengths_v.shape[0]
    # Two consecutive rows hold more than `length` tokens (the second opened because an
    # example did not fit in the first, which was open or full), so rows <= 2 T / L + 2.
    kept = int(np.minimum(lengths, length).sum())
    cdef i64 max_rows = min(n_examples, 2 * kept // length + 2)
    cdef Out out
    arrays = allocate(&out, max_rows, length)
    # The open rows, oldest first: index, free slots, segments placed so far.
    cdef i64 *open_row = <i64 *> malloc((max_open_rows + 1) * sizeof(i64))
    cdef i32 *open_free = <i32 *> malloc((max_open_rows + 1) * sizeof(i32))
    cdef i32 *open_segments = <i32 *> malloc((max_open_rows + 1) * sizeof(i32))
    if open_row == NULL or open_free == NULL or open_segments == NULL:
        free(open_row); free(open_free); free(open_segments)
        raise MemoryError()
    cdef Py_ssize_t i, s, n_open = 0, close
    cdef bint overflow = False
    cdef i64 start = 0, rows = 0
    cdef i32 n
    try:
        with nogil:
            for i in range(n_examples):
                n = <i32> min(lengths_v[i], length)
                if n > 0:
                    s = 0
                    while s < n_open and open_free[s] < n:
                        s += 1
                    if s == n_open:  # no open row has room: open one
                        if rows == max_rows:
                            overflow = True  # cannot happen (see max_rows)
                            break
                        open_row[s] = rows
                        open_free[s] = <i32> length
                        open_segments[s] = 0
                        n_open += 1
                        rows += 1
                    open_segments[s] += 1
                    put(&out, open_row[s], <i32> length - open_free[s], &tokens_v[0] + start,
                        n, open_segments[s], False)
                    open_free[s] -= n
                    close = -1
                    if open_free[s] == 0:
                        close = s
                    elif n_open > max_open_rows:
                        close = 0
                        pad(&out, open_row[0], <i32> length - open_free[0])
                    if close >= 0:
                        n_open -= 1
                        for s in range(close, n_open):
                            open_row[s] = open_row[s + 1]
                            open_free[s] = open_free[s + 1]
                            open_segments[s] = open_segments[s + 1]
                start += lengths_v[i]
            for s in range(n_open):
                pad(&out, open_row[s], <i32> length - open_free[s])
    finally:
        free(open_row); free(open_free); free(open_segments)
    if overflow:
        raise RuntimeError(f"first-fit needed more than its bound of {max_rows} rows")
    return shrink(arrays, rows, length)


def pack_next_fit(tokens, lengths, Py_ssize_t length, chunk_size=None):
    """seqio's packing: next-fit within chunks of `chunk_size` examples (default: `length`)."""
    cdef Py_ssize_t chunk = length if chunk_size is None else chunk_size
    tokens, lengths = validate(tokens, lengths, length, chunk, "chunk_size")
    cdef const i32[::1] tokens_v = tokens
    cdef const i64[::1] lengths_v = lengths
    cdef Py_ssize_t n_examples = lengths_v.shape[0]
    # Within a chunk two consecutive rows hold more than `length` tokens, so a chunk of T_c
    # tokens has at most 2 T_c / L + 2 rows; and no row without an example of its own.
    kept = int(np.minimum(lengths, length).sum())
    n_chunks = (n_examples + chunk - 1) // chunk
    cdef i64 max_rows = min(n_examples, 2 * kept // length + 2 * n_chunks)
    cdef Out out
    arrays = allocate(&out, max_rows, length)
    cdef Py_ssize_t i, j, n
    cdef i64 start = 0, row = -1
    cdef bint overflow = False
    cdef i32 nonzero, fill = 0, segments = 0
    cdef const i32 *example
    with nogil:
        for i in range(n_examples):
            if i % chunk == 0:  # every chunk starts on a fresh row
                if row >= 0:
                    pad(&out, row, fill)
                if row + 1 == max_rows:
                    overflow = True  # cannot happen (see max_rows)
                    break
                row += 1
                fill = 0
                segments = 0
            # seqio keeps the first (count of non-zero tokens) tokens of the trimmed example.
            n = min(lengths_v[i], length)
            example = &tokens_v[0] + start
            start += lengths_v[i]
            nonzero = 0
            for j in range(n):
                nonzero += example[j] != 0
            if nonzero == 0:
                continue
            if fill + nonzero > length:
                pad(&out, row, fill)
                if row + 1 == max_rows:
                    overflow = True  # cannot happen (see max_rows)
                    break
                row += 1
                fill = 0
                segments = 0
            segments += 1
            put(&out, row, fill, example, nonzero, segments, True)
            fill += nonzero
        if row >= 0:
            pad(&out, row, fill)  # the last chunk's row, closed even when empty
    if overflow:
        raise RuntimeError(f"next-fit needed more than its bound of {max_rows} rows")
    return shrink(arrays, row + 1, length)
