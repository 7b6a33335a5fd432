"""Cython kernels against their NumPy references (exact: integer outputs)."""

from __future__ import annotations

import numpy as np
from capibara_exp.kernels import segment_stats, segment_stats_ref
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def test_kernel_is_the_compiled_extension() -> None:
    assert segment_stats.__file__.endswith((".so", ".pyd")), segment_stats.__file__


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=40),
                  elements=st.integers(0, 4)))
def test_segment_stats_matches_reference(ids: np.ndarray) -> None:
    ids = np.ascontiguousarray(ids)
    got, want = segment_stats.segment_stats(ids), segment_stats_ref.segment_stats(ids)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_segment_stats_on_a_packed_row() -> None:
    ids = np.array([[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    tokens, segments = segment_stats.segment_stats(ids)
    np.testing.assert_array_equal(tokens, [6, 8])
    np.testing.assert_array_equal(segments, [3, 1])
