"""kernels/robust_agg.pyx against its NumPy reference (bit-exact), property-based."""

from __future__ import annotations

import numpy as np
import pytest
from capibara_exp.kernels import robust_agg, robust_agg_ref
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

# Finite values, NaNs and infinities in every mix; up to 12 candidates.
_VALUES = st.one_of(st.floats(-1e6, 1e6, width=32), st.just(float("nan")),
                    st.sampled_from([float("inf"), float("-inf"), 0.0, -0.0]))
_STACKS = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
                     elements=_VALUES)


def test_kernel_is_the_compiled_extension() -> None:
    assert robust_agg.__file__.endswith((".so", ".pyd")), robust_agg.__file__


@settings(max_examples=300, deadline=None)
@given(_STACKS)
def test_nanmedian_matches_reference(x_NxM: np.ndarray) -> None:
    x_NxM = np.ascontiguousarray(x_NxM)
    np.testing.assert_array_equal(robust_agg.nanmedian(x_NxM), robust_agg_ref.nanmedian(x_NxM))


@settings(max_examples=300, deadline=None)
@given(_STACKS, st.integers(0, 6))
def test_trimmed_mean_matches_reference(x_NxM: np.ndarray, trim: int) -> None:
    x_NxM = np.ascontiguousarray(x_NxM)
    np.testing.assert_array_equal(robust_agg.nan_trimmed_mean(x_NxM, trim),
                                  robust_agg_ref.nan_trimmed_mean(x_NxM, trim))


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 50), elements=st.floats(-1e3, 1e3, width=32)),
       st.floats(-10, 10, width=32))
def test_axpy_matches_reference(x_M: np.ndarray, w: float) -> None:
    got, want = np.ones_like(x_M), np.ones_like(x_M)
    robust_agg.axpy(got, x_M, w)
    robust_agg_ref.axpy(want, x_M, w)
    np.testing.assert_array_equal(got, want)


def test_reference_agrees_with_numpy_on_finite_input() -> None:
    x_NxM = np.random.default_rng(0).normal(size=(7, 3000)).astype(np.float32)
    x_NxM[2, :10] = np.nan
    # Several column blocks of the kernel, against the reference.
    np.testing.assert_array_equal(robust_agg.nanmedian(x_NxM), robust_agg_ref.nanmedian(x_NxM))
    np.testing.assert_array_equal(robust_agg.nan_trimmed_mean(x_NxM, 2),
                                  robust_agg_ref.nan_trimmed_mean(x_NxM, 2))
    np.testing.assert_allclose(robust_agg_ref.nanmedian(x_NxM), np.nanmedian(x_NxM, axis=0),
                               rtol=1e-6)
    srt = np.sort(x_NxM[:, 20:], axis=0)
    np.testing.assert_allclose(robust_agg_ref.nan_trimmed_mean(x_NxM[:, 20:], 2),
                               srt[2:5].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_all_nan_column_is_nan_and_negative_trim_is_an_error() -> None:
    x_NxM = np.array([[np.nan, 1.0], [np.nan, 3.0]], np.float32)
    assert np.isnan(robust_agg.nanmedian(x_NxM)[0]) and robust_agg.nanmedian(x_NxM)[1] == 2.0
    with pytest.raises(ValueError, match="trim must be >= 0"):
        robust_agg.nan_trimmed_mean(x_NxM, -1)


@settings(max_examples=100, deadline=None)
@given(_STACKS, st.integers(0, 3))
def test_list_entry_points_match_the_stacked_ones(x_NxM: np.ndarray, trim: int) -> None:
    rows = [np.ascontiguousarray(r) for r in x_NxM]
    np.testing.assert_array_equal(robust_agg.nanmedian_of(rows), robust_agg_ref.nanmedian(x_NxM))
    np.testing.assert_array_equal(robust_agg.nan_trimmed_mean_of(rows, trim),
                                  robust_agg_ref.nan_trimmed_mean(x_NxM, trim))


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(0, 9000)),
                  elements=st.floats(-1e3, 1e3, width=32)))
def test_weighted_sum_matches_reference(x_NxM: np.ndarray) -> None:
    rows = list(x_NxM)
    weights = list(np.linspace(0.1, 1.0, len(rows)))
    np.testing.assert_array_equal(robust_agg.weighted_sum_of(rows, weights),
                                  robust_agg_ref.weighted_sum_of(rows, weights))


def test_batcher_network_sorts_every_zero_one_input() -> None:
    pairs = robust_agg.batcher_pairs(8)
    for bits in range(256):  # the 0-1 principle: sorting all 0/1 inputs proves the network
        x = [(bits >> i) & 1 for i in range(8)]
        for a, b in pairs:
            if x[a] > x[b]:
                x[a], x[b] = x[b], x[a]
        assert x == sorted(x)


@settings(max_examples=100, deadline=None)
@given(_STACKS, st.integers(0, 3))
def test_writing_into_the_first_candidate_matches_a_fresh_output(x_NxM: np.ndarray,
                                                                 trim: int) -> None:
    """A merge hands its read buffers over: the result may overwrite candidate 0."""
    weights = list(np.linspace(0.1, 1.0, len(x_NxM)))
    cases = [(robust_agg.nanmedian_of, (), robust_agg_ref.nanmedian(x_NxM)),
             (robust_agg.nan_trimmed_mean_of, (trim,),
              robust_agg_ref.nan_trimmed_mean(x_NxM, trim)),
             (robust_agg.weighted_sum_of, (weights,),
              robust_agg_ref.weighted_sum_of(list(x_NxM), weights))]
    for fn, args, want in cases:
        rows = [np.array(r) for r in x_NxM]
        got = fn(rows, *args, out=rows[0])
        assert np.shares_memory(got, rows[0])
        np.testing.assert_array_equal(got, want)


def test_an_output_overlapping_another_candidate_is_refused() -> None:
    buf = np.arange(9, dtype=np.float32)
    rows = [buf[:8], *(np.arange(8, dtype=np.float32) + i for i in (1, 2))]
    for fn, args in ((robust_agg.nanmedian_of, ()), (robust_agg.weighted_sum_of, ([1.0] * 3,))):
        with pytest.raises(ValueError, match="out overlaps candidate 1"):
            fn(rows, *args, out=rows[1])
        with pytest.raises(ValueError, match="out overlaps candidate 0"):
            fn(rows, *args, out=buf[1:])  # shifted by one: later elements read after written
        with pytest.raises(ValueError, match="writeable C-contiguous float32"):
            fn(rows, *args, out=np.empty(8, np.float64))


@pytest.mark.parametrize("allow_avx2", [False, True])
def test_both_instruction_sets_match_the_reference(allow_avx2: bool) -> None:
    """The import picks AVX2 where the CPU has it; the baseline kernels must agree too."""
    rng = np.random.default_rng(1)
    x_NxM = rng.normal(size=(9, 2500)).astype(np.float32)
    x_NxM[rng.random(x_NxM.shape) < 0.05] = np.nan
    x_NxM[3, :7] = np.inf
    x_NxM[:, 100] = np.nan
    rows = list(x_NxM)
    weights = list(np.linspace(0.1, 1.0, len(rows)))
    try:
        robust_agg.select_simd(allow_avx2)
        np.testing.assert_array_equal(robust_agg.nanmedian_of(rows),
                                      robust_agg_ref.nanmedian(x_NxM))
        np.testing.assert_array_equal(robust_agg.nan_trimmed_mean_of(rows, 2),
                                      robust_agg_ref.nan_trimmed_mean(x_NxM, 2))
        np.testing.assert_array_equal(robust_agg.nanmedian_of(rows[:8]),
                                      robust_agg_ref.nanmedian(x_NxM[:8]))
        clean = [np.nan_to_num(r, posinf=0.0) for r in rows]
        np.testing.assert_array_equal(robust_agg.weighted_sum_of(clean, weights),
                                      robust_agg_ref.weighted_sum_of(clean, weights))
    finally:
        assert robust_agg.select_simd() == robust_agg.SIMD


@settings(max_examples=200, deadline=None)
@given(_STACKS)
def test_the_gates_finite_check_matches_numpy(x_NxM: np.ndarray) -> None:
    from capibara_exp.consensus import methods

    for row in x_NxM:
        assert methods.all_finite(row) == bool(np.isfinite(row).all())
    huge = np.full(8, 3e38, np.float32)  # finite, but its sum overflows
    assert methods.all_finite(huge) and not methods.all_finite(np.append(huge, np.nan))


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 70000)),
                  elements=st.floats(-1e3, 1e3, width=32)))
def test_blocked_distances_to_the_median_match_numpy(x_NxM: np.ndarray) -> None:
    from capibara_exp.consensus import methods

    center = np.median(x_NxM, axis=0).astype(np.float32)
    want = ((x_NxM.astype(np.float64) - center) ** 2).sum(axis=1)
    np.testing.assert_allclose(methods.sq_distances_to(list(x_NxM), center), want, rtol=1e-5,
                               atol=1e-6)
