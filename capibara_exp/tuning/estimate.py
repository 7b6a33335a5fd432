"""The step-time model: a compiled step's schedule played on one chip.

XLA's own `optimal_seconds` is negative (a sentinel) for real train steps and its
`cost_analysis()` counts loop bodies once, so neither can rank candidates. This model
replays the schedule XLA wrote (tuning/profile.py) on two resources, the core and the
interconnect:

- an op takes max(FLOPs / (peak x mxu_efficiency), bytes / (HBM bandwidth x
  hbm_efficiency)): fusions are compute- or memory-bound, not both;
- a collective takes its bytes over the links its group uses (tuning/estimate's
  `collective_seconds`): within a slice, a bidirectional ring along each ICI axis the
  group spans; across slices, each chip's share of the data-center network (DCN); plus a
  fixed latency;
- a synchronous collective stalls the core; an asynchronous one (start ... done) runs
  while the core computes what XLA scheduled in between, and the core waits at `done`
  only if it is not finished; a collective fused with compute overlaps that fusion.
  Collectives run one at a time. Loop bodies play once and count trip-count times.

The efficiencies are the model's constants (StepModel): 1.0 is the chip's datasheet;
tuning/calibration.py fits them to published TPU measurements (MaxText's v5e results).
MFU is model FLOPs per chip (PaLM's count) over (step time x bf16 peak).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from capibara_exp.base.topologies import Chip
from capibara_exp.tuning.profile import StepProfile


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Constants of the step-time model; tuning/calibration.py says where each comes from."""

    mxu_efficiency: float = 1.0  # share of bf16 peak a matmul fusion sustains
    hbm_efficiency: float = 1.0  # share of HBM bandwidth a memory-bound op sustains
    ici_efficiency: float = 1.0  # share of link bandwidth a collective sustains
    dcn_efficiency: float = 1.0  # share of a chip's DCN bandwidth a cross-slice transfer gets
    collective_latency_s: float = 5e-6  # per collective, whatever its size
    # Share of a synchronous collective the core does not wait for: XLA schedules compute
    # that does not depend on it around it, which the TPU runs while the collective's DMAs
    # move data (0: the core waits for all of it; async pairs are played as scheduled).
    collective_overlap: float = 0.0


DATASHEET = StepModel()
# The constants fitted on MaxText's published v5e results (tuning/calibration.py fits them and
# says where they come from; bench/calibrate.py prints the fit; a test checks these are it):
# - mxu_efficiency: the share of bf16 peak a matmul sustains (tiling, pipeline bubbles);
# - collective_overlap: the share of a synchronous collective hidden behind the compute XLA
#   schedules around it (asynchronous ones are played as scheduled).
# The others stay at the datasheet: HBM and ICI at their published bandwidth.
FITTED = {"mxu_efficiency": 0.890, "collective_overlap": 0.473}
CALIBRATED = dataclasses.replace(DATASHEET, **FITTED)
# Where FITTED comes from, and how far to trust it: the generations of its calibration points
# (v5e only; published results on other generations are checked, never fitted) and the
# worst leave-one-out error of those points, relative (tests/test_step_model.py recomputes
# it). Per-generation physics (peak, HBM, ICI, DCN) come from the datasheets in
# capibara_exp/base/topologies.py; only the efficiencies are fitted.
CALIBRATED_ON = ("v5e",)
LEAVE_ONE_OUT_ERROR = 0.056


def calibration_note(chip: Chip) -> dict[str, Any]:
    """What an estimate for `chip` states about its constants: the generations they were
    fitted on, the leave-one-out error bar, and a warning for a generation without a
    calibration point (its HBM bandwidth per FLOP, for one, differs from v5e's)."""
    warning = ""
    if chip.generation not in CALIBRATED_ON:
        warning = (f"{chip.generation or chip.kind} has no calibration point: the efficiencies "
                   f"were fitted on {', '.join(CALIBRATED_ON)} only, so the error bar "
                   f"(+-{LEAVE_ONE_OUT_ERROR:.1%}) is not known to hold")
    return {"calibrated_on": list(CALIBRATED_ON), "est_error_bar": LEAVE_ONE_OUT_ERROR,
            "calibration_warning": warning}


@dataclasses.dataclass(frozen=True)
class Estimate:
    step_s: float
    compute_s: float  # matmul FLOPs / (peak x mxu_efficiency), summed over ops
    memory_s: float  # HBM bytes / (bandwidth x hbm_efficiency), summed over ops
    roofline_s: float  # sum over ops of the larger of the two: the core's busy time
    collective_s: float  # every collective's duration, overlapped or not
    exposed_s: float  # time the core waits for collectives (step_s - roofline_s)
    mfu: float  # model FLOPs per chip / (step_s x peak)


def _ring_share(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def collective_seconds(c: dict[str, Any], chip: Chip, model: StepModel = DATASHEET) -> float:
    """One run of a collective: `ici_axes` bidirectional rings within each slice (each chip
    sends on 2 x axes links), then, across `slices`, each chip's shard over its DCN share."""
    g, slices = c["group_size"], max(1, c.get("slices", 1))
    if g <= 1:
        return 0.0
    per_slice = max(1, g // slices)
    axes = max(1, c.get("ici_axes", 1))
    ici = 2 * axes * chip.link_bytes_per_s * model.ici_efficiency
    payload, op = c["bytes"], c["opcode"]
    passes = 2.0 if op == "all-reduce" else 1.0  # reduce-scatter then all-gather
    if op == "collective-permute":  # one hop on one link
        seconds = payload / (chip.link_bytes_per_s * model.ici_efficiency)
    elif op == "all-to-all":  # chunks cross a quarter of each axis' ring on average
        side = per_slice ** (1.0 / axes)
        seconds = _ring_share(per_slice) * payload * max(1.0, side / 4) / ici
    else:
        seconds = passes * _ring_share(per_slice) * payload / ici
    if slices > 1:  # what is left after the slice's own reduction crosses DCN
        dcn = chip.dcn_bytes_per_s * model.dcn_efficiency
        shard = payload / per_slice if op != "all-to-all" else payload
        seconds += passes * _ring_share(slices) * shard / dcn
    return seconds + model.collective_latency_s


@dataclasses.dataclass
class _Clock:
    now: float = 0.0  # the core
    link_free: float = 0.0  # the interconnect
    busy: float = 0.0  # the core's op time
    compute: float = 0.0
    memory: float = 0.0
    collective: float = 0.0
    pending: dict[str, float] = dataclasses.field(default_factory=dict)


class _Player:
    def __init__(self, profile: StepProfile, chip: Chip, model: StepModel):
        self.p, self.chip, self.m = profile, chip, model
        self.loops: dict[str, _Clock] = {}

    def op(self, clock: _Clock, flops: float, moved: float) -> float:
        compute = flops / (self.chip.peak_flops * self.m.mxu_efficiency)
        memory = moved / (self.chip.hbm_bytes_per_s * self.m.hbm_efficiency)
        clock.compute += compute
        clock.memory += memory
        clock.busy += max(compute, memory)
        return max(compute, memory)

    def launch(self, clock: _Clock, collective: dict[str, Any]) -> float:
        """Start a collective on the interconnect when it is free; its end time."""
        seconds = collective_seconds(collective, self.chip, self.m)
        clock.collective += seconds
        start = max(clock.now, clock.link_free)
        clock.link_free = start + seconds
        return clock.link_free

    def play(self, name: str, clock: _Clock) -> None:
        for event in self.p.programs.get(name, []):
            kind = event[0]
            if kind == "op":
                clock.now += self.op(clock, event[1], event[2])
            elif kind == "sync":
                start = max(clock.now, clock.link_free)
                end = self.launch(clock, event[1])
                clock.now = end - self.m.collective_overlap * (end - start)
            elif kind == "start":
                clock.pending[event[1]] = self.launch(clock, event[2])
            elif kind == "dma":  # copies run on their own engines, at HBM bandwidth
                clock.pending[event[1]] = clock.now + event[2] / self.chip.hbm_bytes_per_s
            elif kind == "done":
                clock.now = max(clock.now, clock.pending.pop(event[1], clock.now))
            elif kind == "overlap":
                end = self.launch(clock, event[3])
                clock.now = max(clock.now + self.op(clock, event[1], event[2]), end)
            elif kind in ("loop", "call"):
                self.repeat(event[1], event[2] if kind == "loop" else 1.0, clock)
            elif kind == "branches":
                worst = max(event[1], key=lambda b: self.body(b).now, default=None)
                if worst is not None:
                    self.repeat(worst, 1.0, clock)

    def body(self, name: str) -> _Clock:
        """One run of a computation on its own (its async pairs start and end inside it)."""
        if name not in self.loops:
            clock = _Clock()
            self.play(name, clock)
            clock.now = max(clock.now, clock.link_free, *clock.pending.values())
            self.loops[name] = clock
        return self.loops[name]

    def repeat(self, name: str, times: float, clock: _Clock) -> None:
        one = self.body(name)
        clock.now = max(clock.now, clock.link_free) + times * one.now
        clock.link_free = clock.now
        for field in ("busy", "compute", "memory", "collective"):
            setattr(clock, field, getattr(clock, field) + times * getattr(one, field))


def estimate(profile: StepProfile, chip: Chip, model_flops_per_chip: float,
             model: StepModel = DATASHEET) -> Estimate:
    """Play the step's schedule on one chip under the model's constants."""
    player = _Player(profile, chip, model)
    clock = _Clock()
    player.play(profile.entry, clock)
    step = max(clock.now, clock.link_free, *clock.pending.values())
    mfu = model_flops_per_chip / (step * chip.peak_flops) if step > 0 else 0.0
    return Estimate(step, clock.compute, clock.memory, clock.busy, clock.collective,
                    max(step - clock.busy, 0.0), mfu)
