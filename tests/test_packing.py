"""Packing kernels: Cython == reference exactly, next-fit == real seqio, and round trips."""

from __future__ import annotations

import numpy as np
import pytest
from capibara_exp.kernels import packing, packing_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from capibara_exp.data.packing import Packer

PACKERS = ("pack_first_fit", "pack_next_fit")


def realistic_lengths(n: int, seed: int, median: float = 80, sigma: float = 1.0) -> np.ndarray:
    """Lognormal example lengths, at least one token each."""
    rng = np.random.default_rng(seed)
    return np.ceil(rng.lognormal(np.log(median), sigma, n)).astype(np.int64)


def fill(segment_ids_BxL: np.ndarray) -> float:
    return np.count_nonzero(segment_ids_BxL) / segment_ids_BxL.size


def assert_same(got: tuple, want: tuple) -> None:
    for name, g, w in zip(("targets", "segment_ids", "positions"), got, want, strict=True):
        assert g.dtype == w.dtype == np.int32, name
        assert g.shape == w.shape, (name, g.shape, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)


@st.composite
def examples(draw, max_length: int = 24, tokens: tuple[int, int] = (0, 3)):
    """(tokens, lengths, length): zero-length and over-long examples, L = 1 included."""
    length = draw(st.integers(1, max_length))
    lengths = np.array(draw(st.lists(st.integers(0, 3 * length), max_size=60)), np.int64)
    seed = draw(st.integers(0, 2**32 - 1))
    flat = np.random.default_rng(seed).integers(*tokens, int(lengths.sum()), endpoint=True)
    return flat.astype(np.int32), lengths, length


def test_kernel_is_the_compiled_extension() -> None:
    assert packing.__file__.endswith((".so", ".pyd")), packing.__file__


@settings(max_examples=300, deadline=None)
@given(examples(), st.integers(1, 6))
def test_first_fit_matches_reference(case, max_open_rows: int) -> None:
    tokens, lengths, length = case
    assert_same(packing.pack_first_fit(tokens, lengths, length, max_open_rows),
                packing_ref.pack_first_fit(tokens, lengths, length, max_open_rows))


@settings(max_examples=300, deadline=None)
@given(examples(), st.none() | st.integers(1, 10))
def test_next_fit_matches_reference(case, chunk_size: int | None) -> None:
    tokens, lengths, length = case
    assert_same(packing.pack_next_fit(tokens, lengths, length, chunk_size),
                packing_ref.pack_next_fit(tokens, lengths, length, chunk_size))


@pytest.mark.parametrize("name", PACKERS)
def test_kernel_matches_reference_on_realistic_lengths(name: str) -> None:
    lengths = realistic_lengths(3000, seed=1)
    tokens = np.random.default_rng(2).integers(1, 300, lengths.sum()).astype(np.int32)
    assert_same(getattr(packing, name)(tokens, lengths, 512),
                getattr(packing_ref, name)(tokens, lengths, 512))


@settings(max_examples=200, deadline=None)
@given(examples(tokens=(1, 1)), st.integers(1, 6), st.sampled_from(PACKERS))
def test_round_trip(case, window: int, name: str) -> None:
    """Every kept token appears exactly once, in order, in its own segment; rows are
    left-aligned with segments 1..k; padding is zero everywhere."""
    _, lengths, length = case
    tokens = np.arange(1, lengths.sum() + 1, dtype=np.int32)  # unique and non-zero
    targets, segment_ids, positions = getattr(packing, name)(tokens, lengths, length, window)
    starts = np.cumsum(lengths) - lengths
    kept = np.minimum(lengths, length)
    want = sorted((int(s) + 1, int(n)) for s, n in zip(starts, kept, strict=True) if n)
    got = []
    for row_t, row_s, row_p in zip(targets, segment_ids, positions, strict=True):
        fill_row = np.count_nonzero(row_s)
        assert not row_t[fill_row:].any() and not row_p[fill_row:].any()
        boundaries = np.flatnonzero(row_p[:fill_row] == 0)
        np.testing.assert_array_equal(row_s[boundaries], np.arange(1, boundaries.size + 1))
        for begin, end in zip(boundaries, np.append(boundaries, fill_row)[1:], strict=True):
            segment = row_t[begin:end]
            np.testing.assert_array_equal(segment, segment[0] + np.arange(end - begin))
            np.testing.assert_array_equal(row_p[begin:end], np.arange(end - begin))
            assert (row_s[begin:end] == row_s[begin]).all()
            got.append((int(segment[0]), int(end - begin)))
    assert sorted(got) == want


@settings(max_examples=200, deadline=None)
@given(examples(), st.sampled_from(("first_fit", "next_fit")), st.integers(0, 2**32 - 1))
def test_labels_land_on_their_examples_slots(case, strategy: str, seed: int) -> None:
    """Packer.pack_labels puts each example's label on exactly the slots that carry its
    tokens (segment id != 0) and -1 elsewhere. The oracle packs globally unique token ids
    (0 kept where the token is 0, since next-fit places by non-zero tokens) and reads
    each slot's example back from its id."""
    tokens, lengths, length = case
    labels = np.random.default_rng(seed).integers(0, 6, lengths.size)
    packer = Packer(strategy)
    targets, segment_ids, positions = packer.pack(tokens, lengths, length)
    got = packer.pack_labels(tokens, lengths, labels, length)
    ids = np.arange(1, tokens.size + 1, dtype=np.int32)
    if strategy == "next_fit":
        ids *= tokens != 0
    id_targets, id_segments, id_positions = packer.pack(ids, lengths, length)
    np.testing.assert_array_equal(id_segments, segment_ids)  # same placement
    np.testing.assert_array_equal(id_positions, positions)
    example = np.searchsorted(np.cumsum(lengths), id_targets - 1, side="right")
    want = np.where(id_targets > 0, labels[np.minimum(example, max(lengths.size - 1, 0))], -1)
    assert got.dtype == np.int32 and got.shape == targets.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got >= 0, segment_ids != 0)


def test_bad_labels_are_errors() -> None:
    tokens, lengths = np.arange(1, 6, dtype=np.int32), np.array([2, 3])
    with pytest.raises(ValueError, match="one integer per example"):
        Packer().pack_labels(tokens, lengths, np.array([1]), 4)
    with pytest.raises(ValueError, match=">= 0"):
        Packer().pack_labels(tokens, lengths, np.array([1, -1]), 4)


def test_first_fit_back_fills_within_the_window() -> None:
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8], np.int32)
    lengths = np.array([3, 3, 1, 1])
    targets, segment_ids, positions = packing.pack_first_fit(tokens, lengths, 4, max_open_rows=2)
    np.testing.assert_array_equal(targets, [[1, 2, 3, 7], [4, 5, 6, 8]])
    np.testing.assert_array_equal(segment_ids, [[1, 1, 1, 2], [1, 1, 1, 2]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0], [0, 1, 2, 0]])
    # With one open row, opening the second row closes the first: nothing goes back.
    targets, _, _ = packing.pack_first_fit(tokens, lengths, 4, max_open_rows=1)
    np.testing.assert_array_equal(targets, [[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0]])
    # A row that opens full closes at once and evicts no other: the first row takes the 1.
    targets, _, _ = packing.pack_first_fit(tokens, np.array([3, 4, 1]), 4, max_open_rows=1)
    np.testing.assert_array_equal(targets, [[1, 2, 3, 8], [4, 5, 6, 7]])


@pytest.mark.parametrize("module", [packing, packing_ref], ids=["kernel", "reference"])
@pytest.mark.parametrize("name", PACKERS)
def test_empty_input_and_bad_arguments(module, name: str) -> None:
    pack = getattr(module, name)
    for out in pack(np.zeros(0, np.int32), np.zeros(0, np.int64), 8):
        assert out.shape == (0, 8) and out.dtype == np.int32
    tokens, lengths = np.arange(1, 6, dtype=np.int32), np.array([2, 3])
    with pytest.raises(TypeError, match="int32"):
        pack(tokens.astype(np.int64), lengths, 8)
    with pytest.raises(ValueError, match="sum"):
        pack(tokens, np.array([2, 2]), 8)
    with pytest.raises(ValueError, match=">= 0"):
        pack(tokens, np.array([6, -1]), 8)
    with pytest.raises(ValueError, match="length"):
        pack(tokens, lengths, 0)
    with pytest.raises(ValueError, match="max_open_rows|chunk_size"):
        pack(tokens, lengths, 8, 0)


@pytest.mark.parametrize(("median", "length"), [(80, 512), (200, 1024), (40, 128)])
def test_first_fit_fills_at_least_as_well_as_next_fit(median: float, length: int) -> None:
    lengths = realistic_lengths(5000, seed=median, median=median)
    tokens = np.ones(lengths.sum(), np.int32)
    first = fill(packing.pack_first_fit(tokens, lengths, length)[1])
    next_ = fill(packing.pack_next_fit(tokens, lengths, length)[1])
    assert first >= next_, (first, next_)
    assert first > 0.97, f"first-fit fill {first:.3f}: the design promises about 0.985"


# --- seqio itself ---------------------------------------------------------------------


def seqio_pack(tokens: np.ndarray, lengths: np.ndarray, length: int) -> tuple:
    """seqio.utils.trim_and_pack_dataset (its default tf ops) on these examples, as arrays."""
    import seqio  # lazily: seqio imports TensorFlow
    import tensorflow as tf

    ragged = tf.RaggedTensor.from_row_lengths(tokens, lengths)
    ds = tf.data.Dataset.from_tensor_slices(ragged).map(lambda x: {"targets": x})
    rows = list(seqio.utils.trim_and_pack_dataset(ds, {"targets": length}).as_numpy_iterator())
    keys = ("targets", "targets_segment_ids", "targets_positions")
    return tuple(np.stack([r[k] for r in rows]).astype(np.int32) for k in keys)


def seqio_cases() -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    rng = np.random.default_rng(0)

    def case(lengths, length: int, low: int = 1, high: int = 300):
        lengths = np.asarray(lengths, np.int64)
        return rng.integers(low, high, lengths.sum()).astype(np.int32), lengths, length

    return {
        # Tokens 0..3: seqio keeps the first count-of-non-zero tokens and masks their ids.
        "L=7 zeros inside examples": case(rng.integers(0, 20, 150), 7, low=0, high=4),
        "L=1": case(rng.integers(0, 3, 14), 1),  # chunks of one example: empty rows too
        "L=4 all-empty chunk": case([2, 0, 0, 0, 0, 0, 0, 0, 4], 4),
        "L=512 realistic": case(realistic_lengths(1200, seed=3), 512),  # > 2 chunks of 512
    }


@pytest.mark.parametrize("case", list(seqio_cases()))
def test_next_fit_is_seqio(case: str) -> None:
    tokens, lengths, length = seqio_cases()[case]
    assert_same(packing.pack_next_fit(tokens, lengths, length), seqio_pack(tokens, lengths, length))
