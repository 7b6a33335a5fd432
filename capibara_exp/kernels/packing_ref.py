"""Pure-Python/NumPy reference for packing.pyx: greedy packing into seqio's decoder format.

Both functions take the examples as one flat int32 token array plus per-example lengths and
return `(targets, segment_ids, positions)`, each int32 [rows, length]: tokens (0 on padding),
1, 2, 3... per example within a row (0 on padding), and 0.. within each example (0 on
padding). Examples longer than `length` are trimmed to their first `length` tokens.

- `pack_first_fit`: each example goes into the first open row (in opening order) with room,
  else opens a new row. A row stays open until it is full or until more than `max_open_rows`
  rows are open, when the oldest open row closes. So memory is bounded and rows can be
  streamed out in the order they were opened, at most `max_open_rows` rows behind the input.
  `lengths` is authoritative: every trimmed token is kept, whatever its value.
- `pack_next_fit`: seqio's `trim_and_pack_dataset` (tf ops, one feature) bit for bit. seqio
  packs next-fit within chunks of `chunk_size` examples (its `padded_batch` of
  `max(feature_lengths)`, so chunks of `length` examples) and closes the last row of every
  chunk, even an empty one. Because 0 is its padding id, seqio recovers each example as the
  first n tokens of the trimmed example, n being its count of non-zero tokens, and gives
  segment id 0 to any token equal to 0.
"""

from __future__ import annotations

import numpy as np


def validate(
    tokens: np.ndarray, lengths: np.ndarray, length: int, window: int, window_name: str
) -> tuple[np.ndarray, np.ndarray]:
    """The inputs as contiguous (int32 tokens, int64 lengths); raises on a malformed call."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths)
    if tokens.ndim != 1 or tokens.dtype != np.int32:
        raise TypeError(f"tokens must be a 1-D int32 array, got {tokens.dtype} {tokens.shape}")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise TypeError(f"lengths must be a 1-D integer array, got {lengths.dtype} {lengths.shape}")
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError("lengths must be >= 0")
    if int(lengths.sum()) != tokens.size:
        raise ValueError(f"sum(lengths) = {int(lengths.sum())} != tokens.size = {tokens.size}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if window < 1:
        raise ValueError(f"{window_name} must be >= 1, got {window}")
    return np.ascontiguousarray(tokens), lengths


def _rows_to_arrays(
    rows: list[list[np.ndarray]], length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of examples (each a list of token arrays) -> (targets, segment_ids, positions)."""
    targets = np.zeros((len(rows), length), np.int32)
    segment_ids = np.zeros((len(rows), length), np.int32)
    positions = np.zeros((len(rows), length), np.int32)
    for r, row in enumerate(rows):
        offset = 0
        for segment, example in enumerate(row, start=1):
            end = offset + example.size
            targets[r, offset:end] = example
            segment_ids[r, offset:end] = segment
            positions[r, offset:end] = np.arange(example.size)
            offset = end
    return targets, segment_ids, positions


def pack_first_fit(
    tokens: np.ndarray, lengths: np.ndarray, length: int, max_open_rows: int = 64
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First-fit packing over a window of at most `max_open_rows` open rows."""
    tokens, lengths = validate(tokens, lengths, length, max_open_rows, "max_open_rows")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    rows: list[list[np.ndarray]] = []
    open_rows: list[list] = []  # [row index, free slots], oldest first
    for i, n in enumerate(lengths.tolist()):
        n = min(n, length)
        if n == 0:
            continue
        example = tokens[starts[i] : starts[i] + n]
        slot = next((s for s in open_rows if s[1] >= n), None)
        if slot is None:
            rows.append([])
            slot = [len(rows) - 1, length]
            open_rows.append(slot)
        rows[slot[0]].append(example)
        slot[1] -= n
        if slot[1] == 0:
            open_rows.remove(slot)
        if len(open_rows) > max_open_rows:
            open_rows.pop(0)
    return _rows_to_arrays(rows, length)


def pack_next_fit(
    tokens: np.ndarray, lengths: np.ndarray, length: int, chunk_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """seqio's packing: next-fit within chunks of `chunk_size` examples (default: `length`)."""
    chunk_size = length if chunk_size is None else chunk_size
    tokens, lengths = validate(tokens, lengths, length, chunk_size, "chunk_size")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    rows: list[list[np.ndarray]] = []
    for chunk_start in range(0, lengths.size, chunk_size):
        partial: list[np.ndarray] = []
        fill = 0
        for i in range(chunk_start, min(chunk_start + chunk_size, lengths.size)):
            trimmed = tokens[starts[i] : starts[i] + min(lengths[i], length)]
            example = trimmed[: np.count_nonzero(trimmed)]
            if fill + example.size > length:
                rows.append(partial)
                partial, fill = [], 0
            if example.size:
                partial.append(example)
                fill += example.size
        rows.append(partial)
    targets, _, positions = _rows_to_arrays(rows, length)
    # seqio's own formula: a segment starts at every position 0, padding and 0 tokens masked.
    segment_ids = np.cumsum(positions == 0, axis=1, dtype=np.int32) * (targets != 0)
    return targets, segment_ids.astype(np.int32), positions
