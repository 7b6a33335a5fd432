"""Evaluate mesh candidates: rule out by the memory bound, compile the rest (in a pool on a
TPU topology), keep each compile's HLO, and time steps in measured mode."""

from __future__ import annotations

import gzip
import hashlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from capibara_exp.errors import ConfigError
from capibara_exp.topologies import Chip
from capibara_exp.tuning import aot, memory
from capibara_exp.tuning.space import Candidate

HLO_DIR = "hlo"
GIB = 2**30


def with_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """cfg with dotlist overrides; a key the config does not have is an error naming it."""
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as err:  # omegaconf's ConfigKeyError and friends
        raise ConfigError(f"tune-mesh candidate override {overrides}: {err}") from err


def save_hlo(out_dir: Path, cand: Candidate, text: str) -> str:
    """The compiled step's HLO, gzipped under <run dir>/hlo/; its path relative to out_dir."""
    name = hashlib.sha1(cand.key.encode()).hexdigest()[:16]
    path = out_dir / HLO_DIR / f"{name}.hlo.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(), compresslevel=6))
    return str(path.relative_to(out_dir))


def rules_for(cand: Candidate, moe: bool) -> tuple:
    """The logical axis rules the candidate's partitioner uses."""
    from capibara_exp.runtime import moe as moe_runtime
    from capibara_exp.runtime import partitioning

    dims = 2 if cand.fsdp else 1
    if moe:
        return moe_runtime.standard_logical_axis_rules(parameter_partitioning_dims=dims)
    return partitioning.standard_logical_axis_rules(parameter_partitioning_dims=dims)


class Evaluator:
    """search.Evaluate for one experiment on one target: records of a batch of candidates."""

    def __init__(self, base: DictConfig, moe: bool, devices: Sequence[Any], chip: Chip,
                 out_dir: Path, settings: DictConfig, pool: Any = None):
        self.base, self.moe, self.devices, self.chip = base, moe, devices, chip
        self.out_dir, self.s, self.pool = out_dir, settings, pool
        self.budget = (1.0 - settings.hbm_margin) * chip.hbm_bytes
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

    def __call__(self, cands: Sequence[Candidate]) -> Iterator[dict[str, Any]]:
        """Each candidate's record, in order, as soon as it is known (pruned ones at once,
        compiled ones as the pool finishes them)."""
        pruned = {c: self.prune(c) if self.s.prune_by_memory else None for c in cands}
        todo = [c for c in cands if pruned[c] is None]
        cfgs = {c: with_overrides(self.base, c.overrides(self.moe)) for c in todo}
        compiled = self.compile([cfgs[c] for c in todo])
        for cand in cands:
            record = pruned[cand]
            if record is None:
                record, text = next(compiled)
                if text:  # kept, so a better profiler can re-read it without compiling
                    record["hlo_file"] = save_hlo(self.out_dir, cand, text)
                if self.s.measure and record["feasible"]:
                    record["measured_step_s"] = self.measure(cfgs[cand])
            self.log(cand, record)
            yield record

    def compile(self, cfgs: Sequence[DictConfig]):
        if self.pool is not None:
            yield from self.pool.compile(cfgs, self.chip, self.s.hbm_margin)
            return
        for cfg in cfgs:
            compiled = aot.compile_step(cfg, self.devices, self.chip, self.s.hbm_margin)
            yield compiled.record(), compiled.hlo_text

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
