"""Execution-based scoring: programs run in the sandbox and are scored against the logged
outcome; pass@k against its definition; hostile programs are contained, scored as failures,
and the programs after them still run."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest

from capibara_exp.generation import execution, pass_at_k, scoring

LIMITS = execution.Limits(cell_timeout_s=2.0, memory_mb=512, max_file_mb=4)
GOOD = {"prompt": "x = 6\n", "stdout": "42\n"}


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 2), (7, 7, 4),
                                     (8, 1, 8), (10, 4, 5)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_pass(n, c, k) -> None:
    subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 pass
    want = sum(any(i < c for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k.pass_at_k(n, c, k), want, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(pass_at_k.pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_interval_brackets_the_mean_and_refuses_too_few_samples() -> None:
    counts = [(4, 0), (4, 1), (4, 4), (4, 2), (4, 0), (4, 3)]
    got = pass_at_k.estimate(counts, 2)
    mean = sum(pass_at_k.pass_at_k(n, c, 2) for n, c in counts) / len(counts)
    assert math.isclose(got["pass@2"], mean)
    assert got["pass@2_low"] < mean < got["pass@2_high"]
    assert pass_at_k.estimate(counts, 2) == got  # seeded: the same figures again
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k.pass_at_k(4, 1, 5)


def test_scoring_against_the_logged_outcome(tmp_path: Path) -> None:
    targets = [GOOD, GOOD, GOOD, {"prompt": "", "stdout": "a\n"}]
    preds = ["print(x * 7)\n", "print(x)\n", "raise SystemExit(3)\n", "print('a')  \n"]
    outcomes = scoring.run_all(targets, [[p] for p in preds], LIMITS, 2)
    assert [scoring.passed(o[0], t) for o, t in zip(outcomes, targets, strict=True)] == [
        True, False, False, True]
    assert scoring.passed(outcomes[1][0], GOOD, mode="no_error")
    got = scoring.codegen_metric(targets, [[p, "print(x * 7)\n"] for p in preds], ks=(1, 2),
                                 limits=LIMITS)
    assert got["pass@1"] == pytest.approx((1 + 0.5 + 0.5 + 0.5) / 4)
    assert got["pass@2"] == 1.0  # every problem has a passing sample among its two
    checker = scoring.codegen_metric(
        [GOOD], ["print(x * 7)\n"], mode="stdout", limits=LIMITS,
        checker="tests.test_execution:_says_six_times_seven")
    assert checker["pass@1"] == 1.0


def _says_six_times_seven(outcome, expected) -> bool:
    return outcome.stdout.strip() == str(6 * 7)


HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                 "        pass\n",
    "endless_loop": "while True:\n    pass\n",
    "huge_output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "huge_memory": "blob = bytearray(4 << 30)\nprint(42)\n",
    "write_outside": "open({marker!r}, 'w').write('x')\nprint(42)\n",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint(42)\n",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                   "os.kill(-1, signal.SIGKILL)\nprint(42)\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_are_contained_and_fail(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "outside" / "marker"
    marker.parent.mkdir()
    marker.parent.chmod(0o777)
    code = HOSTILE[name].format(marker=str(marker))
    scores = scoring.codegen_metric([{"prompt": "", "stdout": "42\n"}, GOOD],
                                    [code, "print(x * 7)\n"], limits=LIMITS, workers=1)
    assert scores["pass@1"] == 0.5  # the hostile one failed, the next one still passed
    assert not marker.exists()
    assert os.getpid() and os.getppid() > 1  # this process and its parent are alive
    outcome = execution.run_program(code, LIMITS)
    assert not outcome.ok and len(outcome.stdout) <= execution.MAX_TEXT
