"""Search the mesh space with an Optuna study: TPE over the candidate's parts, infeasible
candidates (invalid for the mesh, out of HBM, failed compiles) recorded as violated
constraints (Trial.set_constraint) so the sampler learns to avoid them, every compile
cached by candidate.

Each distinct candidate costs one compile (tens of seconds to minutes for a real model),
so the unit of cost is a compile, not a trial: a trial that proposes a candidate already
compiled reuses its result, and one the memory bound rules out (`pruned` in its record)
costs no compile. With a compile pool the study keeps one trial running per worker, asking
for the next as soon as one finishes (TPE's constant liar keeps running trials apart).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna

from capibara_exp.base import optuna_study
from capibara_exp.base.errors import ConfigError
from capibara_exp.base.logical_axes import ACTIVATION_SHARDINGS
from capibara_exp.tuning.mesh_space import REMAT_POLICIES, Candidate

SEARCH_KEY = "tune_mesh.search"  # the config key naming the sampler, for errors
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
    def compiled(self) -> bool:
        """Whether finding this result cost a compile (a pruned candidate did not)."""
        return not self.record.get("pruned")

    @property
    def value(self) -> float:
        return float(self.record.get(OBJECTIVE, 0.0)) if self.feasible else 0.0


# Starts evaluating a candidate: a future of its record (compiled by a pool worker, or
# ready at once when the memory bound rules it out or there is no pool).
Evaluate = Callable[[Candidate], concurrent.futures.Future]


class Cache:
    """Compile results by candidate, in a JSON-lines file: a re-run compiles nothing twice.

    `context` is what every compile of the search depends on besides the candidate (the
    experiment, its libtpu flags, the JAX and libtpu versions: plan.compile_context); a row
    written under another context (or none) is kept in the file but not reused, so changing
    the flags in the same output dir compiles again instead of reading stale figures.
    Without a context (reading a cache to inspect it) every row is read."""

    def __init__(self, path: Path | None, context: dict[str, Any] | None = None):
        self.path = path
        self.context = None if context is None else _digest(context)
        self.results: dict[Candidate, Result] = {}
        self._row_context: dict[Candidate, str | None] = {}
        self._others: list[str] = []  # rows of other contexts, kept as they were
        if path and path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if self.context is not None and row.get("context") != self.context:
                    self._others.append(line)
                    continue
                cand = Candidate(**row["candidate"])
                self.results[cand] = Result(cand, row["record"])
                self._row_context[cand] = row.get("context")

    @property
    def stale(self) -> int:
        """How many kept rows were compiled under another context (not reused)."""
        return len(self._others)

    def other_contexts(self) -> list[str | None]:
        """The context of each kept row compiled under another context."""
        return [json.loads(line).get("context") for line in self._others]

    def _line(self, cand: Candidate, record: dict[str, Any]) -> str:
        return json.dumps({"candidate": dataclasses.asdict(cand), "record": record,
                           "context": self._row_context.get(cand, self.context)}) + "\n"

    def rewrite(self) -> None:
        """Write every result again (after records were updated in place)."""
        if self.path:
            self.path.write_text("".join(line + "\n" for line in self._others) + "".join(
                self._line(c, r.record) for c, r in self.results.items()))

    def put(self, cand: Candidate, record: dict[str, Any]) -> Result:
        """Keep a new result, in memory and at the end of the file (so a search that is
        interrupted loses no compile that finished)."""
        self.results[cand] = Result(cand, record)
        self._row_context[cand] = self.context
        if self.path:
            with self.path.open("a") as f:
                f.write(self._line(cand, record))
        return self.results[cand]


def _digest(context: dict[str, Any]) -> str:
    blob = json.dumps(context, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# The candidate's parts the study samples, each as an index into its sorted values, so TPE
# sees their order (2 model partitions lie between 1 and 4; remat 'dots' between 'none'
# and 'full'). The data axis follows from the others.
PARTS = ("model", "expert", "num_microbatches", "remat_policy", "fsdp", "batch_size",
         "attention", "activation_sharding", "splash_block", "splash_fused_bwd")


def _space(cands: Sequence[Candidate]) -> dict[str, list]:
    """The distinct values of each part, in order."""
    def order(part: str):
        if part == "activation_sharding":
            return ACTIVATION_SHARDINGS.index
        return REMAT_POLICIES.index if part == "remat_policy" else (lambda v: v)

    return {part: sorted({getattr(c, part) for c in cands}, key=order(part)) for part in PARTS}


def _suggest(trial: optuna.trial.BaseTrial, space: dict[str, list]) -> dict[str, Any]:
    return {part: values[trial.suggest_int(part, 0, len(values) - 1)] if len(values) > 1
            else values[0] for part, values in space.items()}


def _decode(params: dict[str, Any], space: dict[str, list]) -> dict[str, Any] | None:
    """A finished trial's parts from its stored indices (None for another space's trial)."""
    try:
        return {part: values[params[part]] if len(values) > 1 else values[0]
                for part, values in space.items()}
    except (KeyError, IndexError, TypeError):
        return None


def _table(cands: Sequence[Candidate]) -> dict[tuple, Candidate]:
    return {tuple(getattr(c, part) for part in PARTS): c for c in cands}


def _lookup(cands: Sequence[Candidate], parts: dict[str, Any] | None) -> Candidate | None:
    if parts is None:
        return None
    return _table(cands).get(tuple(parts[part] for part in PARTS))


SAMPLERS = ("tpe", "random")


def mesh_sampler(name: str, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    """The mesh search's sampler (optuna_study.make_sampler): TPE over the ordered parts,
    jointly (multivariate), after a short random start, with more candidates scored per
    trial than Optuna's default (a mesh space is small and each trial costs a compile, so
    the sampler may think longer); constant liar keeps a batch of trials asked at once apart."""
    if name not in SAMPLERS:  # the parts are indices: only these two sample them as such
        raise ConfigError(f"{SEARCH_KEY}: '{name}' is not one of {list(SAMPLERS)}")
    tpe = {"constant_liar": True, "n_ei_candidates": 64,
           "n_startup_trials": max(3, min(5, n_trials // 4))}
    return optuna_study.make_sampler(name, seed, tpe if name == "tpe" else {}, key=SEARCH_KEY)


def _tell(study: optuna.Study, trial: optuna.Trial, result: Result | None) -> None:
    if result is None:  # e.g. microbatches that do not split this mesh's batch shards
        trial.set_constraint(INFEASIBLE, 1.0)
        optuna_study.tell(study, trial, 0.0, attrs={"reason": "invalid combination"})
        return
    trial.set_constraint(INFEASIBLE, 0.0 if result.feasible else 1.0)
    attrs = {"candidate": result.candidate.key}
    if not result.feasible:
        attrs["reason"] = result.record.get("reason", "")
    optuna_study.tell(study, trial, result.value, attrs=attrs)


def told(study: optuna.Study) -> int:
    """Trials finished (a trial enqueued for later is not one yet)."""
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def _nearest(cand: Candidate, others: Sequence[Candidate], space: dict[str, list],
             draw: random.Random) -> Candidate:
    def steps(other: Candidate) -> int:
        return sum(abs(space[p].index(getattr(other, p)) - space[p].index(getattr(cand, p)))
                   for p in PARTS)

    closest = min(steps(c) for c in others)
    return draw.choice([c for c in others if steps(c) == closest])


def _ready(result: Result) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


def _trials(cands: Sequence[Candidate], study: optuna.Study,
            submit: Callable[[Candidate], concurrent.futures.Future],
            more: Callable[[int], bool], workers: int = 1) -> Iterator[Result]:
    """Keep `workers` compiles running: ask, submit the candidate, and tell each trial as its
    result arrives (a future of a Result); while `more(trials running)`.

    A trial that lands on a candidate the study has already met costs nothing but says
    nothing new either: the study is then told to try next the unmet candidate nearest to
    it (fewest steps along the ordered parts; ties drawn at random, repeatably), so it keeps
    to the region TPE chose without circling in it."""
    space, table = _space(cands), _table(cands)
    met = {c for c in (_lookup(cands, _decode(t.params, space)) for t in study.trials) if c}
    draw = random.Random(len(study.trials))
    running: list[tuple[concurrent.futures.Future, optuna.Trial, Candidate]] = []
    def busy() -> int:  # compiles in flight (a repeat or a cached result takes no worker)
        return len({f for f, _, _ in running if not f.done()})

    while True:
        while busy() < workers and more(len(running)):
            trial = optuna_study.ask(study)
            parts = _suggest(trial, space)
            cand = table.get(tuple(parts[p] for p in PARTS))
            if cand is None:
                _tell(study, trial, None)
                continue
            pending = {c for _, _, c in running}
            if cand in met or cand in pending:
                unmet = [c for c in cands if c not in met and c not in pending]
                if unmet:
                    near = _nearest(cand, unmet, space, draw)
                    study.enqueue_trial({p: space[p].index(getattr(near, p))
                                         for p in PARTS if len(space[p]) > 1})
            same = next((f for f, _, c in running if c == cand), None)
            running.append((same or submit(cand), trial, cand))
        if not running:
            return
        finished, _ = concurrent.futures.wait([f for f, _, _ in running],
                                              return_when=concurrent.futures.FIRST_COMPLETED)
        for entry in [e for e in running if e[0] in finished]:
            running.remove(entry)
            future, trial, cand = entry
            met.add(cand)
            _tell(study, trial, future.result())
            yield future.result()


def _submitter(cache: Cache, evaluate: Evaluate, on_compile: Callable[[Result], None]
               ) -> Callable[[Candidate], concurrent.futures.Future]:
    """submit() for _trials: a cached result at once, else the evaluation's, kept in the
    cache when it arrives."""
    def submit(cand: Candidate) -> concurrent.futures.Future:
        if cand in cache.results:
            return _ready(cache.results[cand])
        out: concurrent.futures.Future = concurrent.futures.Future()

        def keep(future: concurrent.futures.Future) -> None:
            try:
                result = cache.put(cand, future.result())
                on_compile(result)
                out.set_result(result)
            except BaseException as err:  # noqa: BLE001  (handed to whoever waits)
                out.set_exception(err)

        evaluate(cand).add_done_callback(keep)
        return out

    return submit


def optimize(cands: Sequence[Candidate], cache: Cache, evaluate: Evaluate, n_trials: int,
             study: optuna.Study, max_compiles: int | None = None, workers: int = 1,
             deadline: float | None = None) -> list[Result]:
    """Run trials until the study has told n_trials (a re-run continues), max_compiles new
    compiles were spent or time.monotonic() passed `deadline` (compiles already running
    finish), `workers` at a time; return the results in the order the study met them."""
    space = _space(cands)
    order = [cache.results[c] for c in (_lookup(cands, _decode(t.params, space))
                                        for t in study.trials if t.params)
             if c in cache.results]
    compiles = 0

    def count(result: Result) -> None:
        nonlocal compiles
        compiles += result.compiled

    def more(running: int) -> bool:
        return (told(study) + running < n_trials and not past(deadline)
                and (max_compiles is None or compiles + running < max_compiles))

    order += list(_trials(cands, study, _submitter(cache, evaluate, count), more, workers))
    return order


def past(deadline: float | None) -> bool:
    """Whether a search's time budget (a time.monotonic() deadline) is spent."""
    return deadline is not None and time.monotonic() >= deadline


def exhaustive(cands: Sequence[Candidate], cache: Cache, evaluate: Evaluate,
               workers: int = 1, deadline: float | None = None) -> list[Result]:
    """Every candidate, in order, `workers` compiles at a time (a cached or pruned one takes
    no worker); none is started after `deadline` (those running finish)."""
    submit = _submitter(cache, evaluate, lambda result: None)
    futures: list[concurrent.futures.Future] = []
    for cand in cands:
        while sum(not f.done() for f in futures) >= workers:
            concurrent.futures.wait([f for f in futures if not f.done()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        if past(deadline) and cand not in cache.results:
            break
        futures.append(submit(cand))
    return [future.result() for future in futures]


def best(results: Sequence[Result]) -> Result | None:
    feasible = [r for r in results if r.feasible]
    return max(feasible, key=lambda r: r.value) if feasible else None


def compiles_to_optimum(cands: Sequence[Candidate], table: dict[Candidate, Result],
                        sampler: str, seeds: Sequence[int], max_trials: int) -> list[int | None]:
    """For each seed, how many distinct candidates a fresh study compiles before it first
    meets the exhaustive optimum (None: not within max_trials), replayed on the table one
    trial at a time; candidates the memory bound pruned cost no compile."""
    optimum = best(list(table.values()))
    if optimum is None:
        return [None for _ in seeds]
    out: list[int | None] = []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for seed in seeds:
        study = optuna_study.create_or_load(
            optuna.storages.InMemoryStorage(), None, ["maximize"],
            sampler=mesh_sampler(sampler, seed, max_trials)).study
        seen: set[Candidate] = set()
        found = None
        for result in _trials(cands, study, lambda c: _ready(table[c]),  # noqa: B023
                              lambda running: told(study) + running < max_trials):  # noqa: B023
            if result.compiled:
                seen.add(result.candidate)
            if math.isclose(result.value, optimum.value, rel_tol=1e-12):
                found = len(seen)
                break
        out.append(found)
    return out
