"""The torture's small version (tests/torture.py; `python -m tests.torture --full` runs the
issue's counts): one kill -9, three bit flips, NaN at every kind of save, the NaN guard,
one SIGTERM, every bad merge parameter and poisoned candidates, against one reference run."""

from __future__ import annotations

import random

import pytest

from tests import torture


@pytest.mark.slow
def test_torture_small(tmp_path, data_dir) -> None:
    tally = torture.torture(tmp_path, torture.SMALL, seed=random.Random().randrange(1000))
    assert tally.failed == 0, tally.table()
    for case in ("kill -9, bitwise resume", "bit flip detected, fallback", "NaN never saved",
                 "SIGTERM/SIGINT loses no step", "bad merge parameter",
                 "no non-finite state written"):
        assert tally.results[case] and all(tally.results[case]), case
