"""A step-time model for a compiled step on one chip: per-op roofline plus collectives.

XLA's own `optimal_seconds` is negative (a sentinel) for real train steps and its
`cost_analysis()` counts loop bodies once, so neither can rank candidates. This model
reads the step's HLO profile (tuning/hlo.py):

- each top-level op costs max(its matmul FLOPs / peak, its HBM bytes / HBM bandwidth):
  fusions are either compute- or memory-bound, not both;
- each collective costs its bytes over the ICI links a ring along one torus axis uses
  (two per chip, one each way), plus a fixed latency;
- collectives are not assumed to overlap compute (XLA's async collectives overlap some,
  so the estimate errs slow, alike for every candidate).

Model FLOPs (PaLM's count, runtime/metrics.py) over the estimated step time and the
chip's bf16 peak give the MFU a candidate should reach.
"""

from __future__ import annotations

import dataclasses

from capibara_exp.topologies import Chip
from capibara_exp.tuning.hlo import Collective, StepProfile

COLLECTIVE_LATENCY_S = 5e-6


@dataclasses.dataclass(frozen=True)
class Estimate:
    step_s: float
    compute_s: float  # sum of matmul FLOPs / peak
    memory_s: float  # sum of HBM bytes / bandwidth
    roofline_s: float  # sum over ops of the larger of the two
    collective_s: float
    mfu: float  # model FLOPs per chip / (step_s x peak)


def collective_seconds(c: Collective, chip: Chip) -> float:
    """One run of a collective over a bidirectional ring of `group_size` chips."""
    g = c.group_size
    if g <= 1:
        return 0.0
    ring_bytes_per_s = 2 * chip.link_bytes_per_s
    share = (g - 1) / g
    if c.opcode == "all-reduce":  # reduce-scatter then all-gather
        seconds = 2 * share * c.bytes / ring_bytes_per_s
    elif c.opcode in ("all-gather", "reduce-scatter"):
        seconds = share * c.bytes / ring_bytes_per_s
    elif c.opcode == "all-to-all":  # each chunk travels a quarter of the ring on average
        seconds = share * c.bytes * max(1.0, g / 4) / ring_bytes_per_s
    else:  # collective-permute: one hop on one link
        seconds = c.bytes / chip.link_bytes_per_s
    return seconds + COLLECTIVE_LATENCY_S


def estimate(profile: StepProfile, chip: Chip, model_flops_per_chip: float) -> Estimate:
    compute = sum(f * n for f, _, n in profile.ops) / chip.peak_flops
    memory = sum(b * n for _, b, n in profile.ops) / chip.hbm_bytes_per_s
    roofline = sum(max(f / chip.peak_flops, b / chip.hbm_bytes_per_s) * n
                   for f, b, n in profile.ops)
    comm = sum(collective_seconds(c, chip) * c.count for c in profile.collectives)
    step = roofline + comm
    mfu = model_flops_per_chip / (step * chip.peak_flops) if step > 0 else 0.0
    return Estimate(step, compute, memory, roofline, comm, mfu)
