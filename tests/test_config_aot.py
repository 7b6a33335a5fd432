"""Config CI: every shipped experiment's train step compiles for the topology it declares,
through the path a run takes (gin from conf/, the trainer's jitted step), ahead of time."""

from __future__ import annotations

import platform
import sys

import jax
import pytest

from capibara_exp import topologies
from capibara_exp.tuning import aot, topology
from capibara_exp.tuning.measure import local_chip
from tests.conftest import EXPERIMENTS, compose_config

LIBTPU_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_compiles_for_its_topology(name):
    cfg = compose_config([f"experiment={name}"])
    if cfg.topology == "cpu":
        devices = jax.devices()
        chip = local_chip(devices, cfg.model.dtype)
    else:
        if not LIBTPU_PLATFORM:
            pytest.skip(f"{name} declares {cfg.topology}: compiling for TPUs needs libtpu, "
                        f"published for Linux x86_64 only (this is {sys.platform} "
                        f"{platform.machine()})")
        assert topology.libtpu_installed(), topology.INSTALL_HINT
        target = topologies.get(cfg.topology)
        devices, chip = topology.devices(target), target.chip
    compiled = aot.compile_step(cfg, devices, chip, hbm_margin=0.05)
    assert compiled.feasible, compiled.reason
    assert 0 < compiled.memory_bytes <= 0.95 * chip.hbm_bytes
    # The step does at least the model's FLOPs (more with remat), and the estimate is a time.
    record = compiled.record()
    assert record["flops"] >= 0.95 * record["model_flops"] > 0
    assert 0 < record["est_mfu"] < 1
