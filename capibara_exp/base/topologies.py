"""TPU slices and their chips: one table for launching (launch/) and planning (tuning/).

A leaf module (no JAX, no project imports). Every slice libtpu compiles for among v4, v5e,
v5p and v6e up to 256 chips is here, by the name users give it: the Cloud accelerator
type's size (`v5e-64`, `v6e-256`; v4 and v5p count TensorCores, two per chip:
`v5p-512` is 256 chips), and `<N>x<slice>` for N slices joined over the data-center
network (DCN) as MaxText's `num_slices` (`2xv5e-256`: 512 chips, the batch split over the
slices). Slice shapes are the ones `jax.experimental.topologies.get_topology_desc`
accepts (probed with libtpu 0.0.42; tests/test_tuning.py describes every entry).

Chip figures are Google Cloud's published specifications (docs.cloud.google.com/tpu/docs/
v4, v5e, v5p, v6e): bf16 peak, HBM capacity and bandwidth, bidirectional ICI bandwidth per
chip over its ports, DCN bandwidth per chip (the host NICs shared by the host's chips).
Figures Cloud does not publish are marked as assumptions where they are set.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a slice."""

    kind: str  # jax's device_kind
    peak_flops: float  # bf16 FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # bidirectional, all ports of the chip together
    ici_ports: int
    dcn_bytes_per_s: float = 0.0  # each way, this chip's share of its host's NICs
    # HBM a program may use as XLA:TPU itself states it ("exceeds available HBM (15.75G)"),
    # probed with libtpu 0.0.42 (tests/test_tuning.py re-reads it); 0: hbm_bytes.
    xla_hbm_bytes: float = 0.0
    generation: str = ""  # v4 | v5e | v5p | v6e ("" off TPU)

    @property
    def usable_hbm_bytes(self) -> float:
        """What one program may hold per chip: XLA's stated figure (the runtime's reserve
        already taken out), else the datasheet's capacity."""
        return self.xla_hbm_bytes or self.hbm_bytes

    @property
    def link_bytes_per_s(self) -> float:
        """One ICI link in one direction."""
        return self.ici_bytes_per_s / (2 * self.ici_ports)


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as users name it: v5e-64, 2xv5e-256
    generation: str  # v4 | v5e | v5p | v6e
    shape: tuple[int, ...]  # chips along the slice's ICI axes, e.g. (8, 8) or (4, 4, 8)
    accelerator_type: str  # gcloud's --accelerator-type (TPU_ACCELERATOR_TYPE) of one slice
    chips_per_host: int  # chips per TPU VM, i.e. per JAX process
    chip: Chip
    num_slices: int = 1
    # get_topology_desc's keyword arguments beyond the name (megacore, host bounds).
    libtpu_options: tuple[tuple[str, object], ...] = ()

    @property
    def jax_name(self) -> str:
        """get_topology_desc's name of one slice, e.g. v5e:8x8."""
        return f"{self.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        """JAX devices in all slices together."""
        return math.prod(self.shape) * self.num_slices

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.shape)

    @property
    def hosts(self) -> int:
        """TPU VMs (JAX processes) of one slice."""
        return max(1, self.chips_per_slice // self.chips_per_host)


# v5e: 197 TFLOP/s, 16 GB at 819 GB/s, ICI 400 GB/s bidirectional over 4 ports; hosts of
# 8 chips with 2 x 100 Gbps NICs (6.4 Tbps per 256-chip pod): 25 Gbps = 3.125 GB/s a chip.
V5E = Chip("TPU v5 lite", 197e12, 16 * GIB, 819e9, 400e9, 4, 3.125e9, 15.75 * GIB, "v5e")
# v6e: 918 TFLOP/s, 32 GB at 1640 GB/s, ICI 800 GB/s over 4 ports; 4 x 200 Gbps NICs per
# 8-chip host (25.6 Tbps per pod): 100 Gbps = 12.5 GB/s a chip.
V6E = Chip("TPU v6 lite", 918e12, 32 * GIB, 1640e9, 800e9, 4, 12.5e9, 31.25 * GIB, "v6e")
# v5p: 459 TFLOP/s, 95 GiB at 2765 GB/s, ICI 1200 GB/s over 6 ports (3D torus), DCN
# 50 Gbps = 6.25 GB/s a chip. One JAX device per chip (its two TensorCores as one).
V5P = Chip("TPU v5", 459e12, 95 * GIB, 2765e9, 1200e9, 6, 6.25e9, 95.74 * GIB, "v5p")
# v4: 275 TFLOP/s, 32 GiB at 1200 GB/s; JAX sees a chip as one device (megacore). ICI is
# not in Cloud's table: taken as 6 links of 400 Gb/s (50 GB/s) each way, 600 GB/s
# bidirectional (an assumption); DCN taken as v5p's 50 Gbps a chip (an assumption).
V4 = Chip("TPU v4", 275e12, 32 * GIB, 1200e9, 600e9, 6, 6.25e9, 30.75 * GIB, "v4")

# 2D generations: the Cloud slice shapes (1x1 ... 16x16; libtpu also takes 1x2, 2x8, 2x16
# and 4x16, which Cloud does not sell). Up to 8 chips is one host; larger slices are VMs
# of 4 chips (ct5lp-hightpu-4t, ct6e-standard-4t), libtpu's default host bounds.
_SHAPES_2D = [(1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)]
# 3D generations: one shape per chip count libtpu accepts, the most cube-like of each
# (4x4x4 for 64 chips rather than 2x4x8 or 2x2x16); hosts of 4 chips.
_SHAPES_3D = [(2, 2, 1), (2, 2, 2), (2, 2, 3), (2, 2, 4), (2, 2, 5), (2, 2, 6), (2, 4, 4),
              (2, 4, 5), (2, 4, 6), (4, 4, 4), (2, 6, 6), (4, 4, 5), (4, 4, 6), (4, 4, 8),
              (4, 6, 6), (4, 6, 8), (6, 6, 6), (4, 8, 8)]


def _two_d(generation: str, chip: Chip, cloud_prefix: str) -> list[Topology]:
    out = []
    for shape in _SHAPES_2D:
        chips = math.prod(shape)
        per_host = chips if chips <= 8 else 4
        options = ((("chips_per_host_bounds", (*shape, 1)),) if chips <= 8 else ())
        out.append(Topology(f"{generation}-{chips}", generation, shape,
                            f"{cloud_prefix}-{chips}", per_host, chip, 1, options))
    return out


def _three_d(generation: str, chip: Chip, options: tuple = ()) -> list[Topology]:
    return [Topology(f"{generation}-{2 * math.prod(s)}", generation, s,
                     f"{generation}-{2 * math.prod(s)}", 4, chip, 1, options)
            for s in _SHAPES_3D]


SLICES: dict[str, Topology] = {t.name: t for t in (
    _two_d("v5e", V5E, "v5litepod") + _two_d("v6e", V6E, "v6e")
    + _three_d("v4", V4, (("chip_config_name", "megacore"),)) + _three_d("v5p", V5P))}

_MULTI = re.compile(r"^(\d+)x(v\w+-\d+)$")


def get(name: str) -> Topology:
    """A slice by name, or N of them over DCN ('2xv5e-256'); ValueError naming the known ones."""
    found = _MULTI.match(name)
    slices, single = (int(found.group(1)), found.group(2)) if found else (1, name)
    if single not in SLICES or slices < 1:
        raise ValueError(f"topology: unknown TPU slice '{name}' (known: {', '.join(SLICES)}; "
                         "N slices over DCN: '<N>x<slice>', e.g. 2xv5e-256)")
    return dataclasses.replace(SLICES[single], name=name, num_slices=slices)


LIBTPU_FLAGS_ENV = "LIBTPU_INIT_ARGS"


def with_libtpu_flags(current: str | None, flags: str | None) -> str | None:
    """LIBTPU_INIT_ARGS for an experiment's libtpu flags (`libtpu_init_args`): its flags
    after any the environment already holds; None when neither has any."""
    current, flags = (current or "").strip(), (flags or "").strip()
    if flags and (current == flags or current.endswith(" " + flags)):
        return current  # already there (a second call in this process, or a child's)
    return " ".join(p for p in (current, flags) if p) or None


def export_libtpu_flags(flags: str | None) -> None:
    """Put an experiment's libtpu flags in this process's LIBTPU_INIT_ARGS (after any it
    holds), before libtpu starts: it reads them once, and child processes inherit them."""
    combined = with_libtpu_flags(os.environ.get(LIBTPU_FLAGS_ENV), flags)
    if combined:
        os.environ[LIBTPU_FLAGS_ENV] = combined


def libtpu_environment(topology: Topology) -> dict[str, str]:
    """What libtpu needs in the environment to describe a slice without one attached: the
    slice type and one worker host name per host (else it logs start-up errors), and leave
    to share libtpu with other processes (its lockfile allows one by default)."""
    return {"TPU_ACCELERATOR_TYPE": topology.accelerator_type,
            "TPU_WORKER_HOSTNAMES": ",".join(["localhost"] * topology.hosts),
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
