"""`capibara-exp-tune-mesh`: search mesh shapes for an experiment on a TPU slice.

For the composed experiment and a target topology: enumerate the candidates (tuning/space),
compile each one the search picks for the topology (tuning/aot), rank them by the step-time
model (tuning/estimate), optionally time them on the devices present (tuning/measure), and
write the report and a conf/partitioning entry for the winner (tuning/report).
"""

from __future__ import annotations

import gzip
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from capibara_exp.base import model_facts, topologies
from capibara_exp.base.errors import ConfigError
from capibara_exp.base.topologies import Chip
from capibara_exp.tuning import aot, confirm, mesh_space, plan_report, profile, search, tpu_slice
from capibara_exp.tuning.evaluator import Evaluator

LOCAL = ("cpu", "local")  # the devices present, not a TPU slice
STUDY_DB = "mesh_study.db"
CACHE = "candidates.jsonl"


def experiment_config(cfg: DictConfig) -> DictConfig:
    """The experiment as capibara-exp composes it: the config without the planner's keys."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("tune_mesh", None)
    out = OmegaConf.create(plain)
    OmegaConf.set_struct(out, True)
    return out


def compile_context(base: DictConfig, early_stop: bool = False) -> dict[str, Any]:
    """What every candidate's compile depends on besides the candidate: the experiment as
    composed (its libtpu flags included), the compiler's versions and, for early-stop
    compiles (whose memory figure differs), that. The result cache reuses only what was
    compiled under the same context."""
    import jax

    early = {"compile_mode": "early_stop"} if early_stop else {}
    return {"experiment": OmegaConf.to_container(base, resolve=False),
            "jax": jax.__version__, "libtpu": tpu_slice.libtpu_version(), **early}


def target(name: str, dtype: str, libtpu_init_args: str | None = None
           ) -> tuple[list[Any], Chip, str]:
    """(devices, chip figures, description) for a topology name or the local devices; a
    TPU topology's compiles run under the experiment's libtpu flags."""
    if name in LOCAL:
        import jax

        from capibara_exp.tuning.measure import local_chip

        devices = jax.devices()
        where = f"{len(devices)} local {devices[0].platform} devices"
        return devices, local_chip(devices, dtype), where
    try:
        topo = topologies.get(name)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return (tpu_slice.devices(topo, libtpu_init_args), topo.chip,
            f"{topo.name} ({topo.jax_name}, {topo.chips} chips)")


def reprofile(cache: search.Cache, out_dir: Path, num_devices: int, chip: Chip) -> int:
    """Bring results of an older profiler or other model constants up to date: re-read their
    saved HLO, or, where none was kept, drop them so they compile again. Returns how many
    were re-read. (A result kept before device coordinates were recorded is re-read as if
    every group ran along one torus axis.)"""
    stale = [r for r in cache.results.values() if r.record.get("feasible") and (
        r.record.get("profile_version") != profile.PROFILE_VERSION
        or r.record.get("step_model") != aot.step_model_id())]
    reread = 0
    for result in stale:
        saved = out_dir / result.record["hlo_file"] if result.record.get("hlo_file") else None
        if saved is not None and saved.exists():
            text = gzip.decompress(saved.read_bytes()).decode()
            result.record.update(aot.profile_fields(text, num_devices, chip,
                                                    result.record["model_flops"],
                                                    result.record.get("device_coords")))
            reread += 1
        else:
            del cache.results[result.candidate]
            logging.getLogger("capibara_exp.tune_mesh").info(
                "%s: profiled by an older profiler and its HLO was not kept; compiling it again",
                result.candidate.key)
    if stale:
        cache.rewrite()
    return reread


def attentions(cfg: DictConfig, local: bool) -> list[str]:
    """The attention implementations to search: tune_mesh.attentions, or (null) dot and
    splash where the model can take splash (rope, no dropout, a length the kernel's blocks
    divide) and the target is a TPU, else dot (on CPU/GPU splash runs as dot anyway). A
    listed one the model cannot take is an error naming the key."""
    from capibara_exp.nets.splash import splash_block

    model = cfg.model
    length = max(cfg.data.task_feature_lengths.values())
    why = []
    if model.position_embedding != "rope":
        why.append(f"model.position_embedding={model.position_embedding} (needs rope)")
    if model.dropout_rate:
        why.append(f"model.dropout_rate={model.dropout_rate} (needs 0)")
    try:
        splash_block(length, model.get("splash_block", 512))
    except ValueError:
        why.append(f"sequence length {length} (needs a multiple of 128, of 512 above 512)")
    listed = cfg.tune_mesh.get("attentions")
    if listed is None:
        return list(model_facts.ATTENTIONS) if not why and not local else ["dot"]
    for name in listed:
        if name not in model_facts.ATTENTIONS:
            raise ConfigError(f"tune_mesh.attentions: '{name}' is not one of "
                              f"{list(model_facts.ATTENTIONS)}")
        if name == "splash" and why:
            raise ConfigError(f"tune_mesh.attentions lists splash, which this model cannot "
                              f"take: {'; '.join(why)}")
    return list(listed)


def splash_choices(cfg: DictConfig) -> dict[str, list]:
    """tune_mesh.splash_blocks / splash_fused_bwd (null: the model's own); a block the
    sequence length cannot take is an error naming the key."""
    from capibara_exp.nets.splash import splash_block

    s, model = cfg.tune_mesh, cfg.model
    blocks = list(s.get("splash_blocks") or [model.get("splash_block", 512)])
    fused = list(s.get("splash_fused_bwd") or [bool(model.get("splash_fused_bwd", False))])
    length = max(cfg.data.task_feature_lengths.values())
    for block in blocks:
        try:
            splash_block(length, block)
        except ValueError as err:
            raise ConfigError(f"tune_mesh.splash_blocks: {block}: {err}") from err
    return {"splash_blocks": blocks, "splash_fused_bwd": fused}


def build_candidates(cfg: DictConfig, chips: int, num_slices: int = 1, local: bool = False
                     ) -> list[mesh_space.Candidate]:
    s = cfg.tune_mesh
    num_experts = cfg.model.get("num_experts")
    cands = mesh_space.candidates(
        chips, cfg.model.num_heads, num_experts, cfg.data.batch_size,
        num_microbatches=list(s.num_microbatches), remat_policies=list(s.remat_policies),
        fsdp=list(s.fsdp), per_chip_batch=list(s.per_chip_batch) if s.per_chip_batch else None,
        attentions=attentions(cfg, local), num_slices=num_slices,
        activation_shardings=list(s.get("activation_shardings") or ["batch"]),
        **splash_choices(cfg),
        model_partitions=list(s.model_partitions) if s.model_partitions else None,
        expert_partitions=list(s.expert_partitions) if s.expert_partitions else None)
    if not cands:
        raise ConfigError(
            f"tune_mesh: no mesh candidate fits {chips} chips ({num_slices} slice(s)) with "
            f"model.num_heads={cfg.model.num_heads}, model.num_experts={num_experts}, "
            f"data.batch_size={cfg.data.batch_size}, tune_mesh.num_microbatches="
            f"{list(s.num_microbatches)}, model_partitions={s.model_partitions}, "
            f"expert_partitions={s.expert_partitions}")
    return cands


def _pool(cfg: DictConfig):
    """A compile pool for a TPU topology (tune_mesh.compile_workers; null: sized to the
    host), or a no-op context when one worker compiles in this process."""
    import contextlib

    from capibara_exp.tuning.pool import CompilePool, default_workers

    workers = cfg.tune_mesh.compile_workers or default_workers()
    if workers < 1:
        raise ConfigError(f"tune_mesh.compile_workers={workers}: give a positive number, or "
                          "null for one per core")
    if workers == 1 or cfg.topology in LOCAL or cfg.tune_mesh.measure:
        return contextlib.nullcontext(None), 1
    return CompilePool(cfg.topology, workers), workers


def search_space(cfg: DictConfig, cands, cache, evaluator, workers: int, out_dir: Path,
                 deadline: float | None = None):
    """(results, TPE replay or None) of the configured search, stopped at `deadline`."""
    s = cfg.tune_mesh
    if s.search == "exhaustive":
        results = search.exhaustive(cands, cache, evaluator, workers, deadline)
        replay = search.compiles_to_optimum(cands, {r.candidate: r for r in results}, "tpe",
                                            list(range(s.replay_seeds)), max(len(cands) * 3, 30))
        return results, replay
    from optuna.trial import TrialState

    from capibara_exp.base import optuna_study

    opened = optuna_study.create_or_load(
        optuna_study.open_storage(f"sqlite:///{out_dir / STUDY_DB}"),
        f"mesh:{cfg.name}:{cfg.topology}", ["maximize"],
        sampler=search.mesh_sampler(s.search, s.seed, s.n_trials))
    for stale in opened.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # A trial still running in the storage belonged to a planner that was stopped: its
        # compile is gone (and cached if it finished), so the study should not wait on it.
        optuna_study.fail(opened, stale.number)
    return search.optimize(cands, cache, evaluator, s.n_trials, opened.study, s.max_compiles,
                           workers=workers, deadline=deadline), None


def budget_deadline(cfg: DictConfig, start: float) -> float | None:
    """tune_mesh.budget_s as a time.monotonic() deadline (null: none); <= 0 is an error."""
    budget = cfg.tune_mesh.get("budget_s")
    if budget is None:
        return None
    if budget <= 0:
        raise ConfigError(f"tune_mesh.budget_s={budget}: give seconds > 0, or null for none")
    return start + float(budget)


def cost_of(results, start: float, deadline: float | None, workers: int) -> dict[str, Any]:
    """What the search cost: wall time, compiles made (cached ones cost nothing now) and
    their summed compile time, and whether the budget stopped it."""
    fresh = list({r.candidate: r for r in results if r.compiled}.values())
    return {"search_s": time.monotonic() - start, "compile_workers": workers,
            "compiles": len(fresh),
            "compile_s_total": sum(float(r.record.get("compile_s", 0.0)) for r in fresh),
            "budget_s": None if deadline is None else deadline - start,
            "stopped_at_budget": search.past(deadline)}


def open_cache(out_dir: Path, base: DictConfig, early_stop: bool, num_devices: int,
               chip: Chip) -> search.Cache:
    """The result cache of one compile mode (early-stop and full rows are kept apart by
    their context), its rows brought up to date (reprofile)."""
    cache = search.Cache(out_dir / CACHE, compile_context(base, early_stop))
    reprofile(cache, out_dir, num_devices, chip)
    return cache


def confirm_cost(fresh: Sequence[search.Result]) -> dict[str, Any]:
    """The full compiles that confirmed early-stop rows (cached ones cost nothing now)."""
    fresh = [r for r in fresh if r.compiled]
    return {"confirm_compiles": len(fresh),
            "confirm_s_total": sum(float(r.record.get("compile_s", 0.0)) for r in fresh)}


def say_stale(out_dir: Path, cache: search.Cache, full_cache: search.Cache) -> None:
    """One stderr line when the cache file holds rows compiled under other settings."""
    stale = sum(c not in (cache.context, full_cache.context) for c in cache.other_contexts())
    if stale:
        print(f"capibara-exp-tune-mesh: {stale} cached result(s) in {out_dir / CACHE} were "
              "compiled under other settings (experiment, libtpu flags or versions): not "
              "reused", file=sys.stderr)


def say_cost(cost: dict[str, Any], workers: int, confirmed: int | None) -> None:
    """What the search cost, on stderr; `confirmed`: rows compiled in full after early stop."""
    print(f"capibara-exp-tune-mesh: search took {cost['search_s']:.0f} s: {cost['compiles']} "
          f"new {'early-stop ' if confirmed is not None else ''}compile(s), "
          f"{cost['compile_s_total']:.0f} s of compiling on {workers} worker(s)"
          + (f"; {confirmed} confirmed by a full compile ({cost['confirm_compiles']} new, "
             f"{cost['confirm_s_total']:.0f} s)" if confirmed is not None else "")
          + ("; stopped at tune_mesh.budget_s" if cost["stopped_at_budget"] else ""),
          file=sys.stderr)


def run(cfg: DictConfig, out_dir: Path, task_overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The task function: search, report, write the partitioning entry; the winner's record."""
    s = cfg.tune_mesh
    if s.search not in ("tpe", "random", "exhaustive"):
        raise ConfigError(f"tune_mesh.search: '{s.search}' is not one of tpe, random, exhaustive")
    if s.measure and cfg.topology not in LOCAL:
        raise ConfigError(f"tune_mesh.measure=true times steps on the devices present; "
                          f"topology={cfg.topology} is not attached here (use topology=cpu, "
                          "or run on the slice itself)")
    base = experiment_config(cfg)
    moe = "num_experts" in cfg.model
    devices, chip, where = target(cfg.topology, cfg.model.dtype, cfg.get("libtpu_init_args"))
    slices = 1 if cfg.topology in LOCAL else topologies.get(cfg.topology).num_slices
    cands = build_candidates(cfg, len(devices), slices, cfg.topology in LOCAL)
    logging.getLogger("capibara_exp.tune_mesh").info("%d candidates on %s", len(cands), where)
    # A TPU topology ranks by early-stop compiles (on the devices present: full ones).
    early_stop = bool(s.get("early_stop")) and cfg.topology not in LOCAL
    cache = open_cache(out_dir, base, early_stop, len(devices), chip)
    full_cache = open_cache(out_dir, base, False, len(devices), chip) if early_stop else cache
    say_stale(out_dir, cache, full_cache)
    start = time.monotonic()
    deadline = budget_deadline(cfg, start)
    pool, workers = _pool(cfg)
    cached, fully_cached = set(cache.results), set(full_cache.results)
    fulls: list[search.Result] = []
    with pool as compile_pool:
        evaluator = Evaluator(base, moe, devices, chip, out_dir, s, compile_pool, early_stop)
        searched, replay = search_space(cfg, cands, cache, evaluator, workers, out_dir,
                                        deadline)
        results = searched
        if early_stop:  # the winner and rows near the HBM budget, compiled in full
            full_eval = Evaluator(base, moe, devices, chip, out_dir, s, compile_pool)
            results, fulls = confirm.confirm(
                searched, evaluator.budget,
                lambda c: search.exhaustive(c, full_cache, full_eval, workers),
                s.confirm_top)
    cost = cost_of([r for r in searched if r.candidate not in cached], start, deadline, workers)
    cost.update(confirm_cost([r for r in fulls if r.candidate not in fully_cached]))
    winner = search.best(results)
    summary = plan_report.write(out_dir, cfg, where, chip, cands, results, winner, replay, cost)
    say_cost(cost, workers, len(fulls) if early_stop else None)
    if winner is not None:
        path, command = plan_report.write_partitioning(cfg, base, winner, moe, s.conf_dir, out_dir,
                                                  s.partitioning_name, task_overrides)
        summary.update(partitioning_file=str(path), command=command)
        print(f"capibara-exp-tune-mesh: best {winner.candidate.key}; wrote {path}\n"
              f"  run it: {command}", file=sys.stderr)
    else:
        print("capibara-exp-tune-mesh: no feasible candidate; see the report for why",
              file=sys.stderr)
    print(f"capibara-exp-tune-mesh: report {out_dir / plan_report.REPORT_MD}", file=sys.stderr)
    return summary
