"""Search the mesh space with an Optuna study: TPE over the candidate's parts, infeasible
candidates (invalid for the mesh, out of HBM, failed compiles) recorded as violated
constraints (Trial.set_constraint) so the sampler learns to avoid them, every compile
cached by candidate.

Each distinct candidate costs one compile (tens of seconds to minutes for a real model),
so the unit of cost is a compile, not a trial: a trial that proposes a candidate already
compiled reuses its result.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna

from capibara_exp.tuning.space import Candidate

OBJECTIVE = "est_mfu"  # maximised; with a fixed global batch, the same order as step time
# Optuna's constraint (> 0: violated) for invalid, out-of-HBM and failed candidates: TPE
# then prefers regions of feasible ones.
INFEASIBLE = "infeasible"


@dataclasses.dataclass
class Result:
    candidate: Candidate
    record: dict[str, Any]  # aot.Compiled.record(), plus measured figures when measured

    @property
    def feasible(self) -> bool:
        return bool(self.record.get("feasible"))

    @property
    def value(self) -> float:
        return float(self.record.get(OBJECTIVE, 0.0)) if self.feasible else 0.0


Evaluate = Callable[[Candidate], dict[str, Any]]


class Cache:
    """Compile results by candidate, in a JSON-lines file: a re-run compiles nothing twice."""

    def __init__(self, path: Path | None):
        self.path = path
        self.results: dict[Candidate, Result] = {}
        if path and path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                cand = Candidate(**row["candidate"])
                self.results[cand] = Result(cand, row["record"])

    def rewrite(self) -> None:
        """Write every result again (after records were updated in place)."""
        if self.path:
            self.path.write_text("".join(
                json.dumps({"candidate": dataclasses.asdict(c), "record": r.record}) + "\n"
                for c, r in self.results.items()))

    def get(self, cand: Candidate, evaluate: Evaluate) -> Result:
        if cand not in self.results:
            result = Result(cand, evaluate(cand))
            self.results[cand] = result
            if self.path:
                with self.path.open("a") as f:
                    f.write(json.dumps({"candidate": dataclasses.asdict(cand),
                                        "record": result.record}) + "\n")
        return self.results[cand]


def _params(cands: Sequence[Candidate]) -> dict[str, list]:
    """The study's categorical parameters: the distinct values of each part."""
    def values(attr):
        return sorted({getattr(c, attr) for c in cands}, key=str)

    return {"mesh": sorted({c.mesh for c in cands}),
            "num_microbatches": values("num_microbatches"),
            "remat_policy": values("remat_policy"),
            "fsdp": values("fsdp"),
            "batch_size": values("batch_size")}


def _lookup(cands: Sequence[Candidate], params: dict[str, Any]) -> Candidate | None:
    for c in cands:
        if (c.mesh == params["mesh"] and c.num_microbatches == params["num_microbatches"]
                and c.remat_policy == params["remat_policy"] and c.fsdp == params["fsdp"]
                and c.batch_size == params["batch_size"]):
            return c
    return None


def make_sampler(name: str, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                          n_startup_trials=max(3, min(10, n_trials // 3)))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"tune_mesh.sampler: '{name}' is not one of ['tpe', 'random']")


def _trials(cands: Sequence[Candidate], study: optuna.Study,
            result_of: Callable[[Candidate], Result], more: Callable[[], bool]
            ) -> Iterator[Result]:
    """Ask, look the candidate up, tell: one trial at a time while `more()`."""
    space = _params(cands)
    while more():
        trial = study.ask()
        params = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        cand = _lookup(cands, params)
        if cand is None:  # e.g. microbatches that do not split this mesh's batch shards
            trial.set_constraint(INFEASIBLE, 1.0)
            trial.set_user_attr("reason", "invalid combination")
            study.tell(trial, 0.0)
            continue
        result = result_of(cand)
        trial.set_constraint(INFEASIBLE, 0.0 if result.feasible else 1.0)
        trial.set_user_attr("candidate", cand.key)
        if not result.feasible:
            trial.set_user_attr("reason", result.record.get("reason", ""))
        study.tell(trial, result.value)
        yield result


def optimize(cands: Sequence[Candidate], cache: Cache, evaluate: Evaluate, n_trials: int,
             study: optuna.Study, max_compiles: int | None = None) -> list[Result]:
    """Run trials until the study holds n_trials (a re-run continues) or max_compiles new
    compiles were spent; return the results in the order the study met them."""
    order = [cache.results[c] for c in (_lookup(cands, t.params) for t in study.trials
                                        if t.params) if c in cache.results]
    compiles = 0

    def result_of(cand: Candidate) -> Result:
        nonlocal compiles
        compiles += cand not in cache.results
        return cache.get(cand, evaluate)

    def more() -> bool:
        return len(study.trials) < n_trials and (max_compiles is None or compiles < max_compiles)

    order += list(_trials(cands, study, result_of, more))
    return order


def exhaustive(cands: Sequence[Candidate], cache: Cache, evaluate: Evaluate) -> list[Result]:
    return [cache.get(c, evaluate) for c in cands]


def best(results: Sequence[Result]) -> Result | None:
    feasible = [r for r in results if r.feasible]
    return max(feasible, key=lambda r: r.value) if feasible else None


def compiles_to_optimum(cands: Sequence[Candidate], table: dict[Candidate, Result],
                        sampler: str, seeds: Sequence[int], max_trials: int) -> list[int | None]:
    """For each seed, how many distinct candidates a fresh study compiles before it first
    meets the exhaustive optimum (None: not within max_trials), replayed on the table."""
    optimum = best(list(table.values()))
    if optimum is None:
        return [None for _ in seeds]
    out: list[int | None] = []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for seed in seeds:
        study = optuna.create_study(direction="maximize",
                                    sampler=make_sampler(sampler, seed, max_trials))
        seen: set[Candidate] = set()
        found = None
        for result in _trials(cands, study, table.__getitem__,
                              lambda: len(study.trials) < max_trials):  # noqa: B023
            seen.add(result.candidate)
            if math.isclose(result.value, optimum.value, rel_tol=1e-12):
                found = len(seen)
                break
        out.append(found)
    return out
