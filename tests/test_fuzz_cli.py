"""The fuzzer of tests/fuzz_cli.py over every console script: exit 0/1/2/75, never a
traceback, a refusal one line that leaves the sandbox as it was. A few hundred cases
here (derandomized: the same ones each run); `python -m bench.fuzz_cli` runs thousands.
CAPIBARA_FUZZ_SCALE=10 multiplies the examples here (the torture mode)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests import fuzz_cli

SCALE = float(os.environ.get("CAPIBARA_FUZZ_SCALE", "1"))
# Examples per script: the Hydra scripts compose a config per case (~0.1-0.3 s).
EXAMPLES = {"capibara-exp": 110, "capibara-exp-merge": 50, "capibara-exp-data": 30,
            "capibara-exp-tune-mesh": 20, "capibara-exp-meta": 20, "capibara-exp-plot": 40,
            "capibara-exp-convert": 40, "capibara-exp-lora": 30, "capibara-exp-generate": 30}


def _fuzz(script: str):
    @settings(max_examples=int(EXAMPLES[script] * SCALE), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(argv=fuzz_cli.script_args(script))
    def check(argv: list[str]) -> None:
        code, err, problem = fuzz_cli.run_case(script, argv)
        assert not problem, f"{script} {argv!r}: {problem}\n{err[-3000:]}"
    return check


@pytest.mark.parametrize("script", sorted(fuzz_cli.SCRIPTS))
def test_fuzzed_command_lines_exit_0_1_2_or_75_in_one_line(script: str) -> None:
    _fuzz(script)()


def test_the_fuzzer_reaches_refusals_and_acceptances() -> None:
    """The generated lines are not all refused the same way: the fuzzer tests the checks
    and the path past them (a fuzzer that only ever hits one error proves little)."""
    cases = [(["--cfg", "job", "model_dir={root}/new"], 0), (["model_dir="], 2),
             (["trainer.train_steps=-5"], 2), (["--gin.TRAIN_STEPS=0"], 2)]
    for argv, expected in cases:
        code, err, problem = fuzz_cli.run_case("capibara-exp", argv)
        assert code == expected and not problem, (argv, code, err)
