"""A generated program's outcome against the logged one: stdout equal and no error
('stdout'), no error ('no_error'), or a user checker ('module:function', called with the
outcome and the expected record, returning a bool). And the seqio metric that runs every
sample of every problem in the execution sandbox and reports pass@k."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from capibara_exp.base.errors import ConfigError
from capibara_exp.generation import execution, pass_at_k

MODES = ("stdout", "no_error")


def _same_stdout(want: str, got: str) -> bool:
    """Equal up to trailing whitespace on lines and at the end (E2B logs keep newlines)."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.rstrip().splitlines())  # noqa: E731
    return norm(want) == norm(got)


def load_checker(spec: str) -> Callable[[execution.Outcome, dict], bool]:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"checker={spec!r}: cannot import it ({err})") from None


def passed(outcome: execution.Outcome, expected: dict, mode: str = "stdout",
           checker: Callable | None = None) -> bool:
    if checker is not None:
        try:
            return bool(checker(outcome, expected))
        except Exception:  # a checker that fails on a strange outcome: not a pass
            return False
    if not outcome.ok:
        return False
    if mode == "no_error":
        return True
    return _same_stdout(expected.get("stdout") or "", outcome.stdout)


def program(expected: dict, completion: str) -> str:
    """The program run: the prompt (a program's start) and the model's continuation."""
    return expected.get("prompt", "") + completion


def run_all(targets: Sequence[dict], samples: Sequence[Sequence[str]],
            limits: execution.Limits, workers: int) -> list[list[execution.Outcome]]:
    """Every sample's outcome, programs run `workers` at a time (each its own sandbox)."""
    jobs = [(i, j, program(t, s)) for i, (t, row) in enumerate(zip(targets, samples, strict=True))
            for j, s in enumerate(row)]
    out: list[list[Any]] = [[None] * len(row) for row in samples]
    with futures.ThreadPoolExecutor(max(1, workers)) as pool:
        done = pool.map(lambda job: (job[0], job[1], execution.run_program(job[2], limits)),
                        jobs)
        for i, j, outcome in done:
            out[i][j] = outcome
    return out


def codegen_metric(targets: Sequence[dict], predictions: Sequence[Any], ks=(1,),
                   mode: str = "stdout", checker: str | None = None,
                   limits: execution.Limits | None = None,
                   workers: int = 2) -> dict[str, Any]:
    """A seqio metric_fn: predictions are one program continuation per problem or a list of
    samples each; pass@k for each k (at most the fewest samples of a problem: a ConfigError
    otherwise), with its interval, and `pass_counts`, each problem's (samples, passed) as a
    JSON text (seqio.metrics.Text: its JSON and TensorBoard loggers keep it)."""
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r}: one of {', '.join(MODES)}")
    samples = [[p] if isinstance(p, str) else list(p) for p in predictions]
    check = load_checker(checker) if checker else None
    outcomes = run_all(targets, samples, limits or execution.Limits(), workers)
    counts = [(len(row), sum(passed(o, t, mode, check) for o in row))
              for t, row in zip(targets, outcomes, strict=True)]
    n = min(c[0] for c in counts)
    too_big = [k for k in ks if k > n]
    if too_big:
        raise ConfigError(f"pass@{too_big[0]} needs at least {too_big[0]} samples per problem, "
                          f"the inference eval drew {n} (infer_eval.infer_eval_num_samples)")
    scores: dict[str, Any] = {}
    for k in ks:
        scores.update(pass_at_k.estimate(counts, k))
    scores["pass_counts"] = seqio_text(json.dumps([list(c) for c in counts]))
    return scores


def seqio_text(text: str) -> Any:
    import seqio

    return seqio.metrics.Text(textdata=text)
