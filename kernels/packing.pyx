# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Greedy packing of variable-length examples into fixed-length rows, in seqio's format.

Same functions, arguments and outputs as packing_ref.py (read its docstring for the exact
semantics): `pack_first_fit` (the better fill) and `pack_next_fit` (seqio bit for bit).
Each runs in two passes without the GIL: place every example (row, offset, segment id) from
the lengths alone, then allocate exactly `rows x length` outputs and copy the tokens.
"""

import numpy as np

cimport numpy as cnp
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from capibara_exp.kernels.packing_ref import validate

cnp.import_array()

ctypedef cnp.int32_t i32
ctypedef cnp.int64_t i64


def pack_first_fit(tokens, lengths, Py_ssize_t length, Py_ssize_t max_open_rows=64):
    """First-fit packing over a window of at most `max_open_rows` open rows."""
    tokens, lengths = validate(tokens, lengths, length, max_open_rows, "max_open_rows")
    cdef const i64[::1] lengths_v = lengths
    cdef Py_ssize_t n_examples = lengths_v.shape[0]
    used = np.empty(n_examples, np.int64)  # example length after trimming
    row_of = np.empty(n_examples, np.int64)
    offset_of = np.empty(n_examples, np.int32)
    segment_of = np.empty(n_examples, np.int32)
    row_fill = np.zeros(n_examples, np.int32)  # tokens per row; no more rows than examples
    cdef i64[::1] used_v = used, row_of_v = row_of
    cdef i32[::1] offset_of_v = offset_of, segment_of_v = segment_of, row_fill_v = row_fill
    # The open rows, oldest first: index, free slots, segments placed so far.
    cdef i64 *open_row = <i64 *> malloc((max_open_rows + 1) * sizeof(i64))
    cdef i32 *open_free = <i32 *> malloc((max_open_rows + 1) * sizeof(i32))
    cdef i32 *open_segments = <i32 *> malloc((max_open_rows + 1) * sizeof(i32))
    if open_row == NULL or open_free == NULL or open_segments == NULL:
        free(open_row); free(open_free); free(open_segments)
        raise MemoryError()
    cdef Py_ssize_t i, s, n_open = 0, remove = -1
    cdef i64 n, rows = 0
    try:
        with nogil:
            for i in range(n_examples):
                n = min(lengths_v[i], length)
                used_v[i] = n
                if n == 0:
                    continue
                s = 0
                while s < n_open and open_free[s] < n:
                    s += 1
                if s == n_open:
                    open_row[s] = rows
                    open_free[s] = <i32> length
                    open_segments[s] = 0
                    n_open += 1
                    rows += 1
                row_of_v[i] = open_row[s]
                offset_of_v[i] = <i32> (length - open_free[s])
                open_segments[s] += 1
                segment_of_v[i] = open_segments[s]
                open_free[s] -= <i32> n
                row_fill_v[open_row[s]] = <i32> (length - open_free[s])
                remove = -1
                if open_free[s] == 0:
                    remove = s
                elif n_open > max_open_rows:
                    remove = 0
                if remove >= 0:
                    n_open -= 1
                    for s in range(remove, n_open):
                        open_row[s] = open_row[s + 1]
                        open_free[s] = open_free[s + 1]
                        open_segments[s] = open_segments[s + 1]
    finally:
        free(open_row); free(open_free); free(open_segments)
    return _scatter(tokens, lengths, used, row_of, offset_of, segment_of, row_fill, rows, length,
                    False)


def pack_next_fit(tokens, lengths, Py_ssize_t length, chunk_size=None):
    """seqio's packing: next-fit within chunks of `chunk_size` examples (default: `length`)."""
    cdef Py_ssize_t chunk = length if chunk_size is None else chunk_size
    tokens, lengths = validate(tokens, lengths, length, chunk, "chunk_size")
    cdef const i32[::1] tokens_v = tokens
    cdef const i64[::1] lengths_v = lengths
    cdef Py_ssize_t n_examples = lengths_v.shape[0]
    used = np.empty(n_examples, np.int64)
    row_of = np.empty(n_examples, np.int64)
    offset_of = np.empty(n_examples, np.int32)
    segment_of = np.empty(n_examples, np.int32)
    row_fill = np.zeros(n_examples, np.int32)  # tokens per row; no more rows than examples
    cdef i64[::1] used_v = used, row_of_v = row_of
    cdef i32[::1] offset_of_v = offset_of, segment_of_v = segment_of, row_fill_v = row_fill
    cdef Py_ssize_t i, j
    cdef i64 start = 0, n, nonzero, rows = 0, fill = 0
    cdef i32 segments = 0
    with nogil:
        for i in range(n_examples):
            # seqio keeps the first (count of non-zero tokens) tokens of the trimmed example.
            n = min(lengths_v[i], length)
            nonzero = 0
            for j in range(start, start + n):
                nonzero += tokens_v[j] != 0
            start += lengths_v[i]
            used_v[i] = nonzero
            if i % chunk == 0:  # a chunk starts on a fresh row
                if i > 0:
                    rows += 1
                fill = 0
                segments = 0
            if nonzero == 0:
                continue
            if fill + nonzero > length:
                rows += 1
                fill = 0
                segments = 0
            segments += 1
            row_of_v[i] = rows
            offset_of_v[i] = <i32> fill
            segment_of_v[i] = segments
            fill += nonzero
            row_fill_v[rows] = <i32> fill
        if n_examples > 0:
            rows += 1  # the last chunk's row, closed even when empty
    return _scatter(tokens, lengths, used, row_of, offset_of, segment_of, row_fill, rows, length,
                    True)


cdef _scatter(tokens, lengths, used, row_of, offset_of, segment_of, row_fill, i64 rows,
              Py_ssize_t length, bint zero_is_padding):
    """Copy every example's first `used` tokens to its place, then zero each row's tail.

    The outputs start uninitialised: zeroing them first (np.zeros) would write every byte
    twice, and writing the outputs is most of this kernel's time.
    """
    targets = np.empty((rows, length), np.int32)
    segment_ids = np.empty((rows, length), np.int32)
    positions = np.empty((rows, length), np.int32)
    cdef i32[:, ::1] targets_v = targets, segment_ids_v = segment_ids, positions_v = positions
    cdef const i32[::1] tokens_v = tokens
    cdef const i64[::1] lengths_v = lengths, used_v = used, row_of_v = row_of
    cdef const i32[::1] offset_of_v = offset_of, segment_of_v = segment_of, row_fill_v = row_fill
    cdef Py_ssize_t i, j, n_examples = lengths_v.shape[0]
    cdef i64 start = 0, n, r
    cdef i32 offset, segment
    cdef i32 *target_row
    cdef i32 *segment_row
    cdef i32 *position_row
    with nogil:
        for i in range(n_examples):
            n = used_v[i]
            if n > 0:
                r = row_of_v[i]
                offset = offset_of_v[i]
                segment = segment_of_v[i]
                target_row = &targets_v[r, offset]
                segment_row = &segment_ids_v[r, offset]
                position_row = &positions_v[r, offset]
                memcpy(target_row, &tokens_v[start], n * sizeof(i32))
                for j in range(n):
                    position_row[j] = <i32> j
                if zero_is_padding:  # seqio masks segment ids wherever the token is 0
                    for j in range(n):
                        segment_row[j] = segment * (target_row[j] != 0)
                else:
                    for j in range(n):
                        segment_row[j] = segment
            start += lengths_v[i]
        for r in range(rows):
            offset = row_fill_v[r]
            n = (length - offset) * sizeof(i32)
            memset(&targets_v[r, 0] + offset, 0, n)
            memset(&segment_ids_v[r, 0] + offset, 0, n)
            memset(&positions_v[r, 0] + offset, 0, n)
    return targets, segment_ids, positions
