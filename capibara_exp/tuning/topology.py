"""TPU slices the mesh planner compiles for, and the chip figures its step-time model uses.

With libtpu installed, JAX compiles for a TPU topology on a machine without TPUs
(`jax.experimental.topologies.get_topology_desc`): the devices it returns can hold a mesh
and a compiled step, but run nothing. Chip figures are Google Cloud's published
specifications (bf16 peak, HBM capacity and bandwidth, bidirectional ICI bandwidth per
chip over its ports).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a slice."""

    kind: str
    peak_flops: float  # bf16 FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # bidirectional, all ports of the chip together
    ici_ports: int

    @property
    def link_bytes_per_s(self) -> float:
        """One ICI link in one direction."""
        return self.ici_bytes_per_s / (2 * self.ici_ports)


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # the slice as users name it, e.g. v5e-64
    jax_name: str  # get_topology_desc's name, e.g. v5e:8x8
    accelerator_type: str  # TPU_ACCELERATOR_TYPE / gcloud's --accelerator-type
    chips: int  # JAX devices
    chips_per_host: int
    chip: Chip

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)


V5E = Chip("TPU v5 lite", 197e12, 16 * GIB, 819e9, 400e9, 4)
V6E = Chip("TPU v6 lite", 918e12, 32 * GIB, 1638e9, 800e9, 4)
# v4: JAX's topology description has one device per TensorCore (two per chip), so a device
# gets half a chip: 275/2 TFLOP/s, 16 of the chip's 32 GiB, half its HBM bandwidth. Its
# ICI (six ports, 3D torus) is taken as 6 links of 50 GB/s each way per chip, shared by
# the two cores: an assumption, not a published figure.
V4_CORE = Chip("TPU v4", 137.5e12, 16 * GIB, 600e9, 300e9, 6)

TOPOLOGIES = {t.name: t for t in (
    Topology("v5e-4", "v5e:2x2", "v5litepod-4", 4, 4, V5E),
    Topology("v5e-8", "v5e:2x4", "v5litepod-8", 8, 8, V5E),
    Topology("v5e-16", "v5e:4x4", "v5litepod-16", 16, 8, V5E),
    Topology("v5e-64", "v5e:8x8", "v5litepod-64", 64, 8, V5E),
    Topology("v5e-256", "v5e:16x16", "v5litepod-256", 256, 8, V5E),
    Topology("v6e-64", "v6e:8x8", "v6e-64", 64, 8, V6E),
    Topology("v4-32", "v4:2x2x4", "v4-32", 32, 8, V4_CORE),
)}


def get(name: str) -> Topology:
    if name not in TOPOLOGIES:
        raise ValueError(f"topology: unknown TPU slice '{name}' (known: {', '.join(TOPOLOGIES)})")
    return TOPOLOGIES[name]


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


INSTALL_HINT = ("compiling for a TPU topology needs libtpu: `pip install 'capibara-exp[tpu]'` "
                "(Linux x86_64); it compiles for TPUs on a machine without them")


def libtpu_environment(topology: Topology) -> dict[str, str]:
    """What libtpu needs in the environment to describe a slice without one attached: the
    slice type and one worker host name per host (else it logs start-up errors), and leave
    to share libtpu with other processes (its lockfile allows one by default)."""
    return {"TPU_ACCELERATOR_TYPE": topology.accelerator_type,
            "TPU_WORKER_HOSTNAMES": ",".join(["localhost"] * topology.hosts),
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def devices(topology: Topology) -> list[Any]:
    """The devices of a TPU slice, for meshes and ahead-of-time compiles only."""
    if not libtpu_installed():
        raise RuntimeError(INSTALL_HINT)
    os.environ.update(libtpu_environment(topology))
    from jax.experimental import topologies

    found = list(topologies.get_topology_desc(platform="tpu",
                                              topology_name=topology.jax_name).devices)
    if len(found) != topology.chips:
        raise RuntimeError(f"topology {topology.name} ({topology.jax_name}): libtpu describes "
                           f"{len(found)} devices, expected {topology.chips}")
    return found
