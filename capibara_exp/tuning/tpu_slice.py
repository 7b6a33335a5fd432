"""The devices of a TPU slice as libtpu describes them, for meshes and ahead-of-time compiles.

With libtpu installed, JAX compiles for a TPU topology on a machine without TPUs
(`jax.experimental.topologies.get_topology_desc`): the devices it returns carry their
physical coordinates and slice, can hold a mesh and a compiled step, but run nothing. The
slices themselves and their chip figures are capibara_exp/base/topologies.py.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.topologies import Topology, export_libtpu_flags, libtpu_environment


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "unknown"


INSTALL_HINT = ("compiling for a TPU topology needs libtpu: `pip install 'capibara-exp[tpu]'` "
                "(Linux x86_64); it compiles for TPUs on a machine without them")


def devices(topology: Topology, libtpu_init_args: str | None = None) -> list[Any]:
    """The devices of a TPU slice (or of N slices over DCN), in libtpu's order. With
    `libtpu_init_args` (the experiment's flags), LIBTPU_INIT_ARGS is set first: libtpu reads
    it once, when it starts in this process, and compiles every step under those flags."""
    if not libtpu_installed():
        raise ConfigError(INSTALL_HINT)  # the user's install to fix: exit 2, one line
    os.environ.update(libtpu_environment(topology))
    export_libtpu_flags(libtpu_init_args)
    from jax.experimental import topologies

    kwargs = dict(topology.libtpu_options)
    if topology.num_slices > 1:
        kwargs["num_slices"] = topology.num_slices
    found = list(topologies.get_topology_desc(platform="tpu", topology_name=topology.jax_name,
                                              **kwargs).devices)
    if len(found) != topology.chips:
        raise RuntimeError(f"topology {topology.name} ({topology.jax_name}): libtpu describes "
                           f"{len(found)} devices, expected {topology.chips}")
    return found
