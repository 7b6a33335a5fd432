"""Confirming early-stop rows with full compiles (tuning/confirm.py): which rows are
compiled in full, whose verdict wins, and the result cache keeping the two modes apart.
The real compiles of both modes are in tests/test_early_stop.py; here the full compiles'
records are a table, as search.compiles_to_optimum replays a table."""

from __future__ import annotations

from omegaconf import OmegaConf

from capibara_exp.tuning import confirm, plan, search
from capibara_exp.tuning.mesh_space import Candidate

GIB = 2**30
BUDGET = 16 * GIB


def cand(model: int) -> Candidate:
    return Candidate(data=8 // model, expert=1, model=model, num_microbatches=1,
                     remat_policy="none", fsdp=False, batch_size=8)


def early_row(c: Candidate, mfu: float, memory: float, feasible: bool = True) -> search.Result:
    reason = "" if feasible else "over HBM budget: more than the chip holds"
    return search.Result(c, {"feasible": feasible, "reason": reason, "est_mfu": mfu,
                             "memory_bytes": memory, "compile_s": 1.0,
                             "compile_mode": "early_stop"})


def full_table(rows: dict[Candidate, tuple[bool, float]]):
    """A `full` for confirm(): each candidate's full-compile verdict and peak, and a log
    of what it was asked to compile."""
    asked: list[Candidate] = []

    def full(cands):
        asked.extend(cands)
        return [search.Result(c, {"feasible": rows[c][0], "memory_bytes": rows[c][1],
                                  "reason": "" if rows[c][0] else "out of HBM: peak",
                                  "est_mfu": 0.5, "compile_s": 9.0, "compile_mode": "full"})
                for c in cands]

    return full, asked


def test_a_candidate_near_the_budget_that_the_full_compile_refuses_is_refused():
    near, second, far = cand(1), cand(2), cand(4)
    # `near` ranks first on its early figure, 1% under the budget; the full compile's peak
    # is over it. The winner is then `second`, confirmed too; `far` is left as ranked.
    results = [early_row(near, 0.6, 0.99 * BUDGET), early_row(second, 0.5, 0.5 * BUDGET),
               early_row(far, 0.4, 0.4 * BUDGET)]
    full, asked = full_table({near: (False, 1.01 * BUDGET), second: (True, 0.52 * BUDGET),
                              far: (True, 0.41 * BUDGET)})
    got, fulls = confirm.confirm(results, BUDGET, full, top=0)
    rows = {r.candidate: r for r in got}
    assert not rows[near].feasible and rows[near].record["compile_mode"] == confirm.CONFIRMED
    assert rows[near].record["early_memory_bytes"] == 0.99 * BUDGET
    winner = search.best(got)
    assert winner.candidate == second and winner.record["compile_mode"] == confirm.CONFIRMED
    assert winner.record["memory_bytes"] == 0.52 * BUDGET  # XLA's peak replaces the early one
    assert rows[far].record["compile_mode"] == "early_stop"
    assert asked == [near, second] and len(fulls) == 2


def test_the_top_rows_and_a_row_refused_only_for_its_early_figure_are_compiled_in_full():
    over, best, other, far_over = cand(1), cand(2), cand(4), cand(8)
    results = [early_row(over, 0.0, 1.02 * BUDGET, feasible=False), early_row(best, 0.5, GIB),
               early_row(other, 0.4, GIB), early_row(far_over, 0.0, 2 * BUDGET, feasible=False)]
    full, asked = full_table({over: (True, 0.97 * BUDGET), best: (True, GIB),
                              other: (True, GIB), far_over: (False, 2 * BUDGET)})
    got, _ = confirm.confirm(results, BUDGET, full, top=2)
    rows = {r.candidate: r for r in got}
    assert rows[over].feasible  # the full compile admits what the early figure refused
    assert set(asked) == {over, best, other}  # not the candidate far over the budget
    assert rows[far_over].record["compile_mode"] == "early_stop"


def test_the_band_is_ten_percent_of_the_budget_or_64_mib():
    assert confirm.band(BUDGET) == 0.1 * BUDGET
    assert confirm.band(100 * 2**20) == 64 * 2**20
    assert confirm.near_budget(early_row(cand(1), 0.5, 0.91 * BUDGET).record, BUDGET)
    assert not confirm.near_budget(early_row(cand(1), 0.5, 0.89 * BUDGET).record, BUDGET)


def test_the_cache_keeps_early_stop_and_full_rows_apart(tmp_path):
    base = OmegaConf.create({"name": "x", "model": {"emb_dim": 8}})
    path = tmp_path / "candidates.jsonl"
    c = cand(2)
    early_cache = search.Cache(path, plan.compile_context(base, True))
    early_cache.put(c, early_row(c, 0.5, GIB).record)
    full_cache = search.Cache(path, plan.compile_context(base, False))
    assert c not in full_cache.results  # an early-stop row is never read as a full one
    full_cache.put(c, {**early_row(c, 0.5, 2 * GIB).record, "compile_mode": "full"})
    again = search.Cache(path, plan.compile_context(base, True))
    assert again.results[c].record["memory_bytes"] == GIB
    assert search.Cache(path, plan.compile_context(base, False)).results[c].record[
        "memory_bytes"] == 2 * GIB
