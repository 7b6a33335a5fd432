"""The console scripts' fuzzer in its torture mode: thousands of generated command lines
(tests/fuzz_cli.py: Hydra's override grammar, Hydra's and T5X's flags, paths of every
kind), each checked for exit 0/1/2/75, no traceback, a refusal in one line that writes
nothing. Prints the exit-status distribution per script and every failing case.

    python -m bench.fuzz_cli                     # 3,000 cases over the eight scripts
    python -m bench.fuzz_cli --examples 10000 --seed 7
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from tests import fuzz_cli

# The share of the cases each script gets (its argument space's size, roughly).
SHARE = {"capibara-exp": 0.35, "capibara-exp-merge": 0.15, "capibara-exp-data": 0.1,
         "capibara-exp-tune-mesh": 0.05, "capibara-exp-meta": 0.05, "capibara-exp-plot": 0.1,
         "capibara-exp-convert": 0.1, "capibara-exp-lora": 0.1}


ones: list = []


def fuzz(script: str, examples: int, seed: int, results: list, failures: list) -> None:
    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(argv=fuzz_cli.script_args(script))
    def check(argv: list[str]) -> None:
        code, err, problem = fuzz_cli.run_case(script, argv)
        results.append((script, code))
        if code == 1:  # an environment failure from an argument: worth reading
            ones.append((script, argv, err[-300:]))
        if problem:
            failures.append((script, argv, problem, err[-500:]))

    check()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=random.randrange(2**31))
    results: list = []
    failures: list = []
    start = time.perf_counter()
    parser.add_argument("--only", help="one script")
    args = parser.parse_args()
    for script, share in SHARE.items():
        if args.only and script != args.only:
            continue
        fuzz(script, max(1, int(args.examples * share)), args.seed, results, failures)
    took = time.perf_counter() - start
    print(f"seed {args.seed}: {len(results)} cases in {took:.0f} s")
    print(f"{'script':26} {'cases':>6} " + " ".join(f"{'exit ' + str(c):>7}" for c in
                                                    sorted(fuzz_cli.SAFE_CODES)))
    for script, counts in sorted(fuzz_cli.tally(results).items()):
        print(f"{script:26} {sum(counts.values()):>6} " +
              " ".join(f"{counts.get(c, 0):>7}" for c in sorted(fuzz_cli.SAFE_CODES)))
    for script, argv, problem, err in failures[:20]:
        print(f"FAIL {script} {argv!r}: {problem}\n  {err!r}")
    for script, argv, err in ones[:10]:
        print(f"exit 1: {script} {argv!r}\n  {err.strip()!r}")
    print(f"{len(failures)} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
