"""Config CI: every shipped experiment's train step compiles for the topology it declares,
through the path a run takes (gin from conf/, the trainer's jitted step), ahead of time; the
splash-attention kernel compiles for v5e.

MaxText's published configurations (conf/experiment/maxtext_v5e_*.yaml, 16B-128B on
v5e-256) take 1-4 minutes each to compile here; their kept HLO (bench/calibration/, from
`python bench/calibrate.py --compile`) is checked against the shipped experiments in
tests/test_step_model.py instead of compiling them on every run. MaxText's v5p and v6e
configurations (conf/experiment/maxtext_v5p_*, maxtext_v6e_*: Llama 2/3 7B-70B at 4,096-8,192
tokens, the 32B/128B on their FSDP x tensor meshes; 3-30 minutes each here) are checked for
what they state (their slice, the recipe's batch per chip, flags libtpu accepts), and those
compiled by `python bench/check_independent.py --compile` for their kept HLO (of the
experiment as shipped, fitting the chip); bench/RESULTS.md has their figures."""

from __future__ import annotations

import platform
import sys

import jax
import pytest

from capibara_exp.base import topologies
from capibara_exp.tuning import aot, calibration, profile, tpu_slice
from capibara_exp.tuning.measure import local_chip
from tests.conftest import EXPERIMENTS, LIBTPU_PLATFORM, compose_config

CALIBRATION = {p.experiment for p in calibration.PUBLISHED}
INDEPENDENT = {p.experiment: p for p in calibration.INDEPENDENT}
COMPILED = [name for name in EXPERIMENTS if name not in CALIBRATION | set(INDEPENDENT)]


def tpu_target(name: str):
    if not LIBTPU_PLATFORM:
        pytest.skip(f"compiling for {name} needs libtpu, published for Linux x86_64 only "
                    f"(this is {sys.platform} {platform.machine()})")
    assert tpu_slice.libtpu_installed(), tpu_slice.INSTALL_HINT
    target = topologies.get(name)
    return tpu_slice.devices(target), target.chip


@pytest.mark.parametrize("name", COMPILED)
def test_experiment_compiles_for_its_topology(name):
    cfg = compose_config([f"experiment={name}"])
    if cfg.topology == "cpu":
        devices = jax.devices()
        chip = local_chip(devices, cfg.model.dtype)
    else:
        devices, chip = tpu_target(cfg.topology)
    compiled = aot.compile_step(cfg, devices, chip)
    assert compiled.feasible, compiled.reason
    assert 0 < compiled.memory_bytes <= chip.usable_hbm_bytes
    # The step does at least the model's FLOPs (more with remat), and the estimate is a time.
    record = compiled.record()
    assert record["flops"] >= 0.95 * record["model_flops"] > 0
    assert 0 < record["est_mfu"] < 1


def test_splash_attention_compiles_for_v5e():
    """A small rope decoder with model.attention=splash, compiled for v5e-4 through the run's
    path: the step holds the kernel's forward and both backward custom calls, and the
    profile counts their FLOPs (the step does at least the model's FLOPs)."""
    devices, chip = tpu_target("v5e-4")
    cfg = compose_config(["model.attention=splash", "model.position_embedding=rope",
                          "model.head_dim=128", "model.num_heads=2", "model.dtype=bfloat16",
                          "data.task_feature_lengths={targets: 512}", "data.batch_size=8",
                          "partitioning.num_partitions=2", "topology=v5e-4"])
    compiled = aot.compile_step(cfg, devices, chip)
    assert compiled.feasible, compiled.reason
    for kernel in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
        assert kernel in compiled.hlo_text, kernel
    step = profile.profile(compiled.hlo_text, len(devices))
    assert step.flops >= compiled.model_flops > 0


@pytest.mark.parametrize("name", sorted(INDEPENDENT))
def test_maxtext_recipe_states_its_slice_batch_and_flags(name):
    """Each recipe experiment composes for a TPU slice at the recipe's batch per chip, with
    splash attention and scanned layers, and libtpu accepts its flags."""
    from tests.test_libtpu_flags import probe

    cfg = compose_config([f"experiment={name}"])
    chips = topologies.get(cfg.topology).chips
    assert cfg.data.batch_size == INDEPENDENT[name].per_chip_batch * chips
    assert cfg.model.attention == "splash" and cfg.model.scan_layers
    assert cfg.libtpu_init_args.startswith("--")
    if LIBTPU_PLATFORM:
        out = probe(cfg.libtpu_init_args)
        assert out.returncode == 0 and "compiled for v5e-1" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(n for n, p in INDEPENDENT.items() if p.kept))
def test_maxtext_recipe_kept_compile_is_current_and_fits(name):
    """A recipe compiled by bench/check_independent.py: its kept HLO is of the experiment as
    shipped, its peak fits what XLA lets a program use on the chip, and the step does at
    least MaxText's count of the model's FLOPs."""
    import gzip
    import json

    meta = json.loads((calibration.DATA_DIR / f"{name}.json").read_text())
    cfg = compose_config([f"experiment={name}"])
    assert meta["fingerprint"] == calibration.fingerprint(cfg), (
        f"{name} changed since its HLO was kept: python bench/check_independent.py "
        f"--compile {name}")
    chip = topologies.get(meta["topology"]).chip
    assert 0 < meta["memory_bytes"] <= chip.usable_hbm_bytes
    text = gzip.decompress((calibration.DATA_DIR / f"{name}.hlo.gz").read_bytes()).decode()
    step = profile.profile(text, meta["chips"], meta["device_coords"])
    assert step.flops >= 0.95 * meta["maxtext_flops"] > 0
