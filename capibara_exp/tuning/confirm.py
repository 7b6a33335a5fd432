"""Confirm early-stop results with full compiles where their memory figure could mislead.

An early-stop compile (tuning/early.py) gives the full compile's profile and estimate, but
its memory figure is the buffer assignment's HBM total, not XLA's peak: measured +2.6%
above it for Llama 3.1 8B at 8,192 tokens on v6e-256 (8.48 vs 8.27 GiB), and below it for a
tiny model whose code and temporaries are settled only in code generation (2.6 vs 14.8 MiB).
So the planner ranks every candidate by early stop, then compiles in full:

- every candidate whose early figure lies within BAND of the HBM budget, on either side
  (BAND = max(10% of the budget, 64 MiB): about four times the 8B's relative disagreement,
  five times the tiny model's absolute one), so that no candidate the full compile refuses
  is admitted, and none it admits is refused for the early figure alone;
- the `top` best feasible candidates (the report's head), and then the best again until
  the winner is a fully compiled row.

A confirmed row is the full compile's record (memory is XLA's peak, feasibility its verdict),
with compile_mode 'early_stop+confirmed' and the early figures kept beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from capibara_exp.tuning import search
from capibara_exp.tuning.search import Result

BAND_FRACTION = 0.10
BAND_FLOOR_BYTES = 64 * 2**20
EARLY, CONFIRMED = "early_stop", "early_stop+confirmed"
# A feasible record, or one refused for its memory figure alone (check_budget's reason).
_OVER_BUDGET = "over HBM budget"


def band(budget: float) -> float:
    return max(BAND_FRACTION * budget, BAND_FLOOR_BYTES)


def near_budget(record: dict[str, Any], budget: float) -> bool:
    """Whether an early-stop row's verdict could change under XLA's peak."""
    if record.get("compile_mode") != EARLY:
        return False
    judged = record.get("feasible") or str(record.get("reason", "")).startswith(_OVER_BUDGET)
    return bool(judged) and abs(float(record.get("memory_bytes", 0.0)) - budget) <= band(budget)


def _unconfirmed(result: Result) -> bool:
    return result.record.get("compile_mode") == EARLY


def merged(early: Result, full: Result) -> Result:
    """The full compile's record for the candidate, marked confirmed, early figures kept."""
    record = {**full.record, "compile_mode": CONFIRMED if full.record.get(
        "compile_mode") == "full" else full.record.get("compile_mode"),
        "early_memory_bytes": early.record.get("memory_bytes"),
        "early_compile_s": early.record.get("compile_s"),
        "confirm_s": full.record.get("compile_s", 0.0)}
    return Result(early.candidate, record)


def confirm(results: Sequence[Result], budget: float,
            full: Callable[[Sequence[Any]], list[Result]], top: int = 3
            ) -> tuple[list[Result], list[Result]]:
    """(results with confirmed rows in place, the full compiles made). `full` compiles
    candidates in full (cached: a candidate confirmed before costs nothing)."""
    rows = {r.candidate: r for r in results}
    fulls: list[Result] = []

    def run(cands: list[Any]) -> None:
        for got in full(cands):
            fulls.append(got)
            rows[got.candidate] = merged(rows[got.candidate], got)

    ranked = sorted((r for r in rows.values() if r.feasible), key=lambda r: -r.value)
    first = [r.candidate for r in rows.values() if near_budget(r.record, budget)]
    first += [r.candidate for r in ranked[:top] if r.candidate not in first]
    run([c for c in first if _unconfirmed(rows[c])])
    while (winner := search.best(list(rows.values()))) is not None and _unconfirmed(winner):
        run([winner.candidate])
    return [rows[r.candidate] for r in results], fulls
