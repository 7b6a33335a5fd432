"""`capibara-exp-tune-mesh`: search mesh shapes for an experiment on a TPU slice.

For the composed experiment and a target topology: enumerate the candidates (tuning/space),
compile each one the search picks for the topology (tuning/aot), rank them by the step-time
model (tuning/estimate), optionally time them on the devices present (tuning/measure), and
write the report and a conf/partitioning entry for the winner (tuning/report).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from capibara_exp import topologies
from capibara_exp.errors import ConfigError
from capibara_exp.topologies import Chip
from capibara_exp.tuning import aot, hlo, report, search, space, topology

LOCAL = ("cpu", "local")  # the devices present, not a TPU slice
STUDY_DB = "mesh_study.db"
CACHE = "candidates.jsonl"
HLO_DIR = "hlo"


def experiment_config(cfg: DictConfig) -> DictConfig:
    """The experiment as capibara-exp composes it: the config without the planner's keys."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("tune_mesh", None)
    out = OmegaConf.create(plain)
    OmegaConf.set_struct(out, True)
    return out


def with_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """cfg with dotlist overrides; a key the config does not have is an error naming it."""
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as err:  # omegaconf's ConfigKeyError and friends
        raise ConfigError(f"tune-mesh candidate override {overrides}: {err}") from err


def target(name: str, dtype: str) -> tuple[list[Any], Chip, str]:
    """(devices, chip figures, description) for a topology name or the local devices."""
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
    return topology.devices(topo), topo.chip, f"{topo.name} ({topo.jax_name}, {topo.chips} chips)"


def save_hlo(out_dir: Path, cand: space.Candidate, text: str) -> str:
    """The compiled step's HLO, gzipped under <run dir>/hlo/; its path relative to out_dir."""
    name = hashlib.sha1(cand.key.encode()).hexdigest()[:16]
    path = out_dir / HLO_DIR / f"{name}.hlo.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(), compresslevel=6))
    return str(path.relative_to(out_dir))


def reprofile(cache: search.Cache, out_dir: Path, num_devices: int, chip: Chip) -> int:
    """Bring results of an older profiler up to date: re-read their saved HLO, or, where none
    was kept, drop them so they compile again. Returns how many were re-read."""
    stale = [r for r in cache.results.values()
             if r.record.get("feasible") and r.record.get("profile_version") != hlo.PROFILE_VERSION]
    reread = 0
    for result in stale:
        saved = out_dir / result.record["hlo_file"] if result.record.get("hlo_file") else None
        if saved is not None and saved.exists():
            text = gzip.decompress(saved.read_bytes()).decode()
            result.record.update(aot.profile_fields(text, num_devices, chip,
                                                    result.record["model_flops"]))
            reread += 1
        else:
            del cache.results[result.candidate]
            logging.getLogger("capibara_exp.tune_mesh").info(
                "%s: profiled by an older profiler and its HLO was not kept; compiling it again",
                result.candidate.key)
    if stale:
        cache.rewrite()
    return reread


def build_candidates(cfg: DictConfig, chips: int) -> list[space.Candidate]:
    s = cfg.tune_mesh
    num_experts = cfg.model.get("num_experts")
    cands = space.candidates(
        chips, cfg.model.num_heads, num_experts, cfg.data.batch_size,
        num_microbatches=list(s.num_microbatches), remat_policies=list(s.remat_policies),
        fsdp=list(s.fsdp), per_chip_batch=list(s.per_chip_batch) if s.per_chip_batch else None,
        model_partitions=list(s.model_partitions) if s.model_partitions else None,
        expert_partitions=list(s.expert_partitions) if s.expert_partitions else None)
    if not cands:
        raise ConfigError(
            f"tune_mesh: no mesh candidate fits {chips} chips with model.num_heads="
            f"{cfg.model.num_heads}, model.num_experts={num_experts}, data.batch_size="
            f"{cfg.data.batch_size}, tune_mesh.num_microbatches={list(s.num_microbatches)}, "
            f"model_partitions={s.model_partitions}, expert_partitions={s.expert_partitions}")
    return cands


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
    devices, chip, where = target(cfg.topology, cfg.model.dtype)
    cands = build_candidates(cfg, len(devices))
    log = logging.getLogger("capibara_exp.tune_mesh")
    log.info("%d candidates on %s", len(cands), where)

    def evaluate(cand: space.Candidate) -> dict[str, Any]:
        cand_cfg = with_overrides(base, cand.overrides(moe))
        compiled = aot.compile_step(cand_cfg, devices, chip, s.hbm_margin)
        record = compiled.record()
        if compiled.hlo_text:  # kept, so a better profiler can re-read it without compiling
            record["hlo_file"] = save_hlo(out_dir, cand, compiled.hlo_text)
        status = (f"est {record['est_step_s'] * 1e3:.1f} ms, MFU {record['est_mfu']:.1%}, "
                  f"{compiled.memory_bytes / 2**30:.2f} GiB" if compiled.feasible
                  else compiled.reason[:120])
        print(f"capibara-exp-tune-mesh: {cand.key}: compiled in {compiled.compile_s:.1f} s; "
              f"{status}", file=sys.stderr, flush=True)
        if s.measure and compiled.feasible:
            from capibara_exp.tuning.measure import time_train_steps

            bindings = aot.train_bindings(aot.render_local_gin(cand_cfg), devices)
            record["measured_step_s"] = time_train_steps(bindings, s.measure_steps)
            import gin

            gin.clear_config(clear_constants=True)
        return record

    cache = search.Cache(out_dir / CACHE)
    reprofile(cache, out_dir, len(devices), chip)
    replay = None
    if s.search == "exhaustive":
        results = search.exhaustive(cands, cache, evaluate)
        replay = search.compiles_to_optimum(cands, {r.candidate: r for r in results}, "tpe",
                                            list(range(s.replay_seeds)), max(len(cands) * 3, 30))
    else:
        import optuna

        study = optuna.create_study(
            study_name=f"mesh:{cfg.name}:{cfg.topology}", direction="maximize",
            storage=f"sqlite:///{out_dir / STUDY_DB}", load_if_exists=True,
            sampler=search.make_sampler(s.search, s.seed, s.n_trials))
        results = search.optimize(cands, cache, evaluate, s.n_trials, study, s.max_compiles)
    winner = search.best(results)
    summary = report.write(out_dir, cfg, where, chip, cands, results, winner, replay)
    if winner is not None:
        path, command = report.write_partitioning(cfg, base, winner, moe, s.conf_dir, out_dir,
                                                  s.partitioning_name, task_overrides)
        summary.update(partitioning_file=str(path), command=command)
        print(f"capibara-exp-tune-mesh: best {winner.candidate.key}; wrote {path}\n"
              f"  run it: {command}", file=sys.stderr)
    else:
        print("capibara-exp-tune-mesh: no feasible candidate; see the report for why",
              file=sys.stderr)
    print(f"capibara-exp-tune-mesh: report {out_dir / report.REPORT_MD}", file=sys.stderr)
    return summary
