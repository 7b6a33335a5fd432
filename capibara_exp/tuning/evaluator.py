"""Evaluate mesh candidates: rule out by the memory bound, compile the rest (in a pool on a
TPU topology), keep each compile's HLO, and time steps in measured mode."""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.topologies import Chip
from capibara_exp.tuning import aot, early, memory
from capibara_exp.tuning.mesh_space import Candidate

HLO_DIR = "hlo"
GIB = 2**30


def with_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """cfg with dotlist overrides; a key the config does not have is an error naming it."""
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as err:  # omegaconf's ConfigKeyError and friends
        raise ConfigError(f"tune-mesh candidate override {overrides}: {err}") from err


def done(value: Any) -> concurrent.futures.Future:
    """A future that already holds its value."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def save_hlo(out_dir: Path, cand: Candidate, text: str) -> str:
    """The compiled step's HLO, gzipped under <run dir>/hlo/; its path relative to out_dir."""
    name = hashlib.sha1(cand.key.encode()).hexdigest()[:16]
    path = out_dir / HLO_DIR / f"{name}.hlo.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(), compresslevel=6))
    return str(path.relative_to(out_dir))


def rules_for(cand: Candidate, moe: bool) -> tuple:
    """The logical axis rules the candidate's partitioner uses."""
    from capibara_exp.base.logical_axes import activation_axis_rules
    from capibara_exp.runtime import contrib_moe as moe_runtime
    from capibara_exp.runtime import partitioning

    dims = 2 if cand.fsdp else 1
    activations = activation_axis_rules(cand.activation_sharding, moe)
    if moe:
        return moe_runtime.standard_logical_axis_rules(parameter_partitioning_dims=dims,
                                                       additional_rules=activations)
    return partitioning.standard_logical_axis_rules(parameter_partitioning_dims=dims,
                                                    additional_rules=activations)


class Evaluator:
    """search.Evaluate for one experiment on one target: records of a batch of candidates."""

    def __init__(self, base: DictConfig, moe: bool, devices: Sequence[Any], chip: Chip,
                 out_dir: Path, settings: DictConfig, pool: Any = None,
                 early_stop: bool = False):
        self.base, self.moe, self.devices, self.chip = base, moe, devices, chip
        self.out_dir, self.s, self.pool = out_dir, settings, pool
        self.early_stop = early_stop  # stop each compile at buffer assignment (early.py)
        self.reserve = settings.hbm_reserve_gib * GIB
        self.budget = aot.hbm_budget(chip, self.reserve)
        self._shapes: memory.Shapes | None = None

    def shapes(self) -> memory.Shapes:
        """The experiment's state shapes, read once (they do not depend on the mesh)."""
        if self._shapes is None:
            import gin

            try:
                bindings = aot.train_bindings(aot.render_local_gin(self.base), self.devices)
                self._shapes = memory.shapes_of(bindings, self.base.model)
            finally:
                gin.clear_config(clear_constants=True)
        return self._shapes

    def prune(self, cand: Candidate) -> dict[str, Any] | None:
        """An infeasible record without compiling when the memory bound exceeds the budget."""
        bound = memory.lower_bound(self.shapes(), cand, rules_for(cand, self.moe))
        if bound <= self.budget:
            return None
        return {"feasible": False, "pruned": True, "compile_s": 0.0, "memory_bytes": bound,
                "reason": f"over HBM before compiling: it holds at least {bound / GIB:.2f} GiB "
                          f"per chip > {self.budget / GIB:.2f} GiB (tuning/memory.py)"}

    def __call__(self, cand: Candidate) -> concurrent.futures.Future:
        """Start evaluating a candidate: a future of its record. A pruned candidate's is
        ready at once; a compile runs on the pool (or here, when there is none)."""
        record = self.prune(cand) if self.s.prune_by_memory else None
        if record is not None:
            self.log(cand, record)
            return done(record)
        cfg = with_overrides(self.base, cand.overrides(self.moe))
        early_stop = self.early_stop
        if self.pool is not None:
            raw = self.pool.submit(cfg, self.chip, self.reserve, early_stop)
        else:
            if early_stop:
                compiled = early.compile_step(cfg, cfg.topology, self.chip, self.reserve)
            else:
                compiled = aot.compile_step(cfg, self.devices, self.chip, self.reserve)
            raw = done((compiled.record(), compiled.hlo_text))
        out: concurrent.futures.Future = concurrent.futures.Future()

        def finish(compiled: concurrent.futures.Future) -> None:
            try:
                out.set_result(self.finish(cand, cfg, *compiled.result()))
            except BaseException as err:  # noqa: BLE001  (handed to whoever waits)
                out.set_exception(err)

        raw.add_done_callback(finish)
        return out

    def finish(self, cand: Candidate, cfg: DictConfig, record: dict[str, Any], text: str
               ) -> dict[str, Any]:
        if text:  # kept, so a better profiler can re-read it without compiling
            record["hlo_file"] = save_hlo(self.out_dir, cand, text)
        if self.s.measure and record["feasible"]:
            record["measured_step_s"] = self.measure(cfg)
        self.log(cand, record)
        return record

    def measure(self, cfg: DictConfig) -> float:
        import gin
        from capibara_exp.tuning.measure import time_train_steps

        try:
            bindings = aot.train_bindings(aot.render_local_gin(cfg), self.devices)
            return time_train_steps(bindings, self.s.measure_steps)
        finally:
            gin.clear_config(clear_constants=True)

    @staticmethod
    def log(cand: Candidate, record: dict[str, Any]) -> None:
        if record["feasible"]:
            status = (f"est {record['est_step_s'] * 1e3:.1f} ms, MFU {record['est_mfu']:.1%}, "
                      f"{record['memory_bytes'] / GIB:.2f} GiB")
        else:
            status = record["reason"][:120]
        how = "pruned" if record.get("pruned") else f"compiled in {record['compile_s']:.1f} s"
        print(f"capibara-exp-tune-mesh: {cand.key}: {how}; {status}", file=sys.stderr,
              flush=True)
