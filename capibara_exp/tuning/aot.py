"""Compile an experiment's real train step for a device set (a TPU topology) without running it.

The path is the one a run takes: the composed config is bridged to the local engine's gin,
gin builds the model, partitioner and trainer class from train_script.train's bindings
(gin_utils.run_bindings), and state.lower_train_step lowers the trainer's jitted step for
shapes only. Only the devices differ: the partitioner lays its mesh over the topology's chips.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import time
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import GIN_DIR
from capibara_exp.base.topologies import Chip
from capibara_exp.composing import gin_bridge
from capibara_exp.tuning import profile
from capibara_exp.tuning.estimate import CALIBRATED, calibration_note, estimate

# XLA:TPU refuses a program over HBM at compile time, saying what it needed: "Ran out of
# memory on HBM, the total memory required for HLO temporaries (27.11G) exceeds available
# HBM (15.75G)", or "Used 20.5G of 15.75G hbm".
_OOM_RE = re.compile(r"(RESOURCE_EXHAUSTED|[Rr]an out of memory|Exceeded hbm capacity)")
_USED_RE = re.compile(r"(?:Used|required for HLO temporaries \()\s*([\d.]+)([KMGT])?")
_UNITS = {None: 1, "": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclasses.dataclass
class Compiled:
    """What one compile of a candidate tells: memory per chip, and from the HLO profile the
    FLOPs, bytes, collectives and estimated step time (`profiled`, see profile_fields)."""

    feasible: bool
    reason: str  # why not, or "" when feasible
    compile_s: float = 0.0  # wall clock
    compile_cpu_s: float = 0.0  # CPU time of this process (XLA's compile threads included)
    memory_bytes: float = 0.0  # per chip: XLA's peak, or what the OOM message says it needs
    model_flops: float = 0.0  # per chip per step, PaLM's analytic count
    xla_flops: float = 0.0  # cost_analysis()'s figure, for comparison (loops counted once)
    profiled: dict[str, Any] = dataclasses.field(default_factory=dict)
    hlo_text: str = dataclasses.field(default="", repr=False)
    # full: lowered.compile(); early_stop: stopped at buffer assignment (tuning/early.py)
    compile_mode: str = "full"

    def record(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items()
               if k not in ("profiled", "hlo_text")}
        return {**out, **self.profiled}


def profile_fields(hlo_text: str, num_devices: int, chip: Chip, model_flops: float,
                   coords: list[list[int]] | None = None) -> dict[str, Any]:
    """Per-chip matmul FLOPs, HBM bytes, collective bytes and the step estimate (est_*) of
    a compiled step's HLO under the calibrated model, tagged with the profiler's version (a
    newer one re-reads it). coords: (x, y, z, slice) of the mesh's devices in order."""
    step = profile.profile(hlo_text, num_devices, coords)
    est = estimate(step, chip, model_flops, CALIBRATED)
    return {"flops": step.flops, "hbm_bytes": step.hbm_bytes,
            "collective_bytes": step.collective_bytes,
            "profile_version": profile.PROFILE_VERSION, "step_model": step_model_id(),
            **calibration_note(chip),
            **{f"est_{k}": v for k, v in dataclasses.asdict(est).items()}}


def step_model_id() -> dict[str, float]:
    """The constants estimates were made with: results made with others are re-read."""
    return dataclasses.asdict(CALIBRATED)


def mesh_coords(mesh: Any) -> list[list[int]] | None:
    """(x, y, z, slice) of a mesh's devices in order; None for devices without coordinates."""
    devices = list(mesh.devices.flat)
    if not all(hasattr(d, "coords") for d in devices):
        return None
    return [[*d.coords, getattr(d, "slice_index", 0) or 0] for d in devices]


def render_local_gin(cfg: DictConfig) -> str:
    """The local engine's config.gin for a composed config (what a run would write)."""
    return gin_bridge.render(cfg, "local", GIN_DIR, {}, "capibara-exp-tune-mesh candidate")


def train_bindings(gin_text: str, devices: Sequence[Any]) -> dict[str, Any]:
    """train_script.train's arguments as gin builds them, with meshes over `devices`."""
    from capibara_exp.runtime import gin_utils, partitioning

    with partitioning.target_devices(devices):
        return gin_utils.run_bindings("config.gin (candidate)", gin_text)


def memory_per_chip(compiled: Any) -> float:
    stats = compiled.memory_analysis()
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    if peak:
        return float(peak)
    return float(stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes + stats.temp_size_in_bytes
                 + stats.generated_code_size_in_bytes)


def oom_bytes(message: str) -> float:
    """What an out-of-HBM compile error says the step needs per chip (0 if it does not)."""
    used = _USED_RE.search(message)
    return float(used.group(1)) * _UNITS[used.group(2)] if used else 0.0


def model_flops_per_chip(bindings: dict[str, Any], num_devices: int) -> float:
    from capibara_exp.runtime.metrics import model_flops_per_token

    model, data = bindings["model"], bindings["train_dataset_cfg"]
    length = max(data.task_feature_lengths.values())
    per_token = model_flops_per_token(getattr(model.module, "config", None), length,
                                      getattr(model.module, "moe_config", None))
    return per_token * data.batch_size * length / num_devices


def hbm_budget(chip: Chip, reserve_bytes: float = 0.0) -> float:
    """Bytes a candidate's peak (XLA's memory analysis) may reach per chip: what XLA states
    a program may use (topologies.Chip.usable_hbm_bytes) less a reserve of one's own
    (tune_mesh.hbm_reserve_gib: buffers a run holds outside the step, measured on a slice)."""
    return max(0.0, chip.usable_hbm_bytes - reserve_bytes)


def lower_step(cfg: DictConfig, devices: Sequence[Any]) -> tuple[Any, float, Any]:
    """(lowered step, model FLOPs per chip, mesh coordinates) of cfg's train step for
    `devices`; ValueError/ConfigError when the mesh or config does not fit."""
    import gin

    try:
        bindings = train_bindings(render_local_gin(cfg), devices)
        from capibara_exp.runtime import state as run_state

        lowered = run_state.lower_train_step(**bindings)
        return (lowered, model_flops_per_chip(bindings, len(devices)),
                mesh_coords(bindings["partitioner"].mesh))
    finally:
        gin.clear_config(clear_constants=True)


def compile_step(cfg: DictConfig, devices: Sequence[Any], chip: Chip,
                 reserve_bytes: float = 0.0) -> Compiled:
    """Compile cfg's train step for `devices`; a config the mesh cannot take, a compile that
    runs out of HBM or a peak over hbm_budget(chip, reserve_bytes) is infeasible."""
    try:
        lowered, model_flops, coords = lower_step(cfg, devices)
    except (ValueError, ConfigError) as err:  # the mesh/config does not fit
        return Compiled(False, f"invalid: {one_line(err)}")
    return compile_lowered(lowered, len(devices), chip, model_flops, coords, reserve_bytes)


def compile_lowered(lowered: Any, num_devices: int, chip: Chip, model_flops: float,
                    coords: Any, reserve_bytes: float = 0.0) -> Compiled:
    """XLA's compile of a lowered step, read as the planner reads it."""
    import jax

    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA raises XlaRuntimeError (and others) for OOM and failures
        return compile_failure(one_line(err), time.perf_counter() - t0,
                               time.process_time() - cpu0)
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    memory = memory_per_chip(compiled)
    text = compiled.as_text()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    fields = profile_fields(text, num_devices, chip, model_flops, coords)
    result = Compiled(True, "", compile_s, compile_cpu_s, memory, model_flops,
                      float(cost.get("flops", 0.0)), {**fields, "device_coords": coords}, text)
    check_budget(result, chip, reserve_bytes)
    del compiled, lowered
    jax.clear_caches()
    gc.collect()
    return result


def compile_failure(message: str, wall_s: float, cpu_s: float) -> Compiled:
    """The infeasible record of a compile XLA refused: out of HBM, or failed."""
    if _OOM_RE.search(message):
        return Compiled(False, f"out of HBM: {message}", wall_s, cpu_s, oom_bytes(message))
    return Compiled(False, f"compile failed: {message}", wall_s, cpu_s)


def check_budget(result: Compiled, chip: Chip, reserve_bytes: float) -> None:
    """Marks a compiled candidate whose memory exceeds the HBM budget infeasible."""
    budget = hbm_budget(chip, reserve_bytes)
    if result.memory_bytes > budget:
        result.feasible = False
        result.reason = (f"over HBM budget: {result.memory_bytes / 2**30:.2f} GiB per chip > "
                         f"{budget / 2**30:.2f} GiB (XLA's {chip.usable_hbm_bytes / 2**30:.2f} "
                         f"GiB less a reserve of {reserve_bytes / 2**30:.2f} GiB)")


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 400 else text[:397] + "..."
