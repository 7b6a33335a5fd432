"""Early-stop compiles (tuning/early.py) against XLA's full compile of the same candidate:
the planner's profile and estimate, and the argument, output and aliased HBM that
`memory_analysis()` states; an out-of-HBM refusal; the fallback to the full compile when
no dump comes; the dump directory removed."""

from __future__ import annotations

import platform
import sys
import tempfile

import pytest

from capibara_exp.base import topologies
from capibara_exp.tuning import aot, confirm, early, hlo
from capibara_exp.tuning import tpu_slice as topology
from tests.conftest import LIBTPU_PLATFORM, compose_config

TINY = ["model=llama3_tiny", "topology=v6e-8", "partitioning=fsdp", "data.batch_size=8",
        "data.task_feature_lengths={targets: 512}"]
# Large enough that XLA prefetches stacked layer weights with asynchronous slices
# (the dump's generic async-start that early.sugared rewrites).
SCANNED = [*TINY, "model.scan_layers=true", "model.num_layers=8", "model.emb_dim=1024",
           "model.num_heads=8", "model.num_kv_heads=8", "model.head_dim=128",
           "model.mlp_dim=2048", "model.dtype=bfloat16"]
PROFILED = ("flops", "hbm_bytes", "collective_bytes", "est_step_s", "est_compute_s",
            "est_memory_s", "est_exposed_s", "est_mfu")


@pytest.fixture(autouse=True)
def own_tmp(tmp_path, monkeypatch):
    if not LIBTPU_PLATFORM:
        pytest.skip(f"compiling for a TPU topology needs libtpu, published for Linux x86_64 "
                    f"only (this is {sys.platform} {platform.machine()})")
    assert topology.libtpu_installed(), topology.INSTALL_HINT
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the dumps go
    return tmp_path


def full_compile(cfg):
    """XLA's full compile of cfg's step, read as aot.compile_step reads it, with its
    memory analysis."""
    target = topologies.get(cfg.topology)
    devices = topology.devices(target)
    lowered, model_flops, coords = aot.lower_step(cfg, devices)
    compiled = lowered.compile()
    fields = aot.profile_fields(compiled.as_text(), len(devices), target.chip, model_flops,
                                coords)
    return compiled.as_text(), fields, compiled.memory_analysis()


@pytest.mark.parametrize("overrides", [TINY, SCANNED], ids=["tiny", "scanned_async_slices"])
def test_early_stop_reads_what_the_full_compile_gives(overrides, own_tmp):
    cfg = compose_config(overrides)
    got = early.compile_step(cfg, cfg.topology, topologies.get(cfg.topology).chip)
    assert got.feasible and got.compile_mode == "early_stop", got.reason
    text, fields, stats = full_compile(cfg)
    for key in PROFILED:
        assert got.profiled[key] == fields[key], key
    assert (got.profiled["argument_bytes"], got.profiled["output_bytes"],
            got.profiled["alias_bytes"]) == (stats.argument_size_in_bytes,
                                             stats.output_size_in_bytes,
                                             stats.alias_size_in_bytes)
    # The scheduled instructions are the full compile's, async ops printed alike.
    assert _ops(got.hlo_text) == _ops(text)
    if overrides is SCANNED:
        assert "slice-start(" in text and "slice-start(" in got.hlo_text
    assert list(own_tmp.iterdir()) == []  # the dumps are removed


def test_out_of_hbm_is_refused_as_the_full_compile_refuses_it(own_tmp):
    cfg = compose_config([*TINY, "data.task_feature_lengths={targets: 65536}",
                          "model.attention=dot"])
    chip = topologies.get(cfg.topology).chip
    got = early.compile_step(cfg, cfg.topology, chip)
    full = aot.compile_step(cfg, topology.devices(topologies.get(cfg.topology)), chip)
    assert not full.feasible and full.reason.startswith("out of HBM")
    assert (got.feasible, got.reason, got.memory_bytes) == (False, full.reason,
                                                            full.memory_bytes)
    assert list(own_tmp.iterdir()) == []


def test_without_dumps_the_full_compiles_record_is_kept(own_tmp, monkeypatch):
    monkeypatch.setattr(early, "MODULE_RE", "^no_such_module$")  # XLA dumps nothing of the step
    cfg = compose_config(TINY)
    chip = topologies.get(cfg.topology).chip
    got = early.compile_step(cfg, cfg.topology, chip)
    full = aot.compile_step(cfg, topology.devices(topologies.get(cfg.topology)), chip)
    assert got.feasible and got.compile_mode == "full"
    assert got.memory_bytes == full.memory_bytes
    assert {k: got.profiled[k] for k in PROFILED} == {k: full.profiled[k] for k in PROFILED}
    assert _ops(got.hlo_text) == _ops(full.hlo_text)  # metadata holds each caller's stack
    assert list(own_tmp.iterdir()) == []


def _ops(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Each computation's instructions in order: name, opcode, result type."""
    return {name: [(i.name, i.opcode, i.shape) for i in comp.instructions]
            for name, comp in hlo.parse(text).items()}


PLAN = ["topology=v5e-4", "tune_mesh.search=exhaustive", "tune_mesh.replay_seeds=1",
        "tune_mesh.num_microbatches=[1]", "tune_mesh.remat_policies=[none]",
        "tune_mesh.fsdp=[false]", "tune_mesh.attentions=[dot]", "model.num_layers=1"]


def plan(tmp_path, name: str, *extra: str) -> dict:
    import json
    import os
    import subprocess

    temp = tmp_path / "tmp"  # the planner's own temporary directory (early-stop dumps)
    temp.mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli.tune_mesh", *PLAN, *extra,
                          f"tune_mesh.conf_dir={tmp_path / 'conf'}", f"hydra.run.dir={name}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TMPDIR": str(temp)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / name / "mesh_results.json").read_text())["results"]
    return {row["candidate"]: row for row in rows}


def test_the_planner_ranks_early_stop_compiles_as_full_ones(own_tmp):
    """tune_mesh.early_stop (the default): every candidate's estimate is the full
    compile's, the winner is compiled in full, and no dump is left behind. A budget set
    between a candidate's early figure and its XLA peak (the tiny step's buffer assignment
    total is below the peak) gets it refused: it lies within the band, so it is confirmed."""
    full = plan(own_tmp, "full", "tune_mesh.early_stop=false")
    got = plan(own_tmp, "early")
    assert set(got) == set(full) and len(full) == 3
    for cand, row in got.items():
        assert row["compile_mode"] in ("early_stop", confirm.CONFIRMED)
        assert full[cand]["compile_mode"] == "full"
        assert {k: row[k] for k in PROFILED} == {k: full[cand][k] for k in PROFILED}, cand
    assert winner(own_tmp, "early")["compile_mode"] == confirm.CONFIRMED
    assert list((own_tmp / "tmp").glob("capibara-early-*")) == []

    top = winner(own_tmp, "full")["candidate"]
    early_figure = got[top].get("early_memory_bytes", got[top]["memory_bytes"])
    peak = full[top]["memory_bytes"]
    assert early_figure < peak
    budget = (early_figure + peak) / 2
    reserve = topologies.get("v5e-4").chip.usable_hbm_bytes - budget
    tight = plan(own_tmp, "tight", f"tune_mesh.hbm_reserve_gib={reserve / 2**30!r}")
    assert not tight[top]["feasible"] and tight[top]["compile_mode"] == confirm.CONFIRMED
    for cand, row in tight.items():  # nothing the full compile refuses is admitted
        assert not row["feasible"] or full[cand]["memory_bytes"] <= budget, cand
    best = winner(own_tmp, "tight")
    assert best is None or best["compile_mode"] == confirm.CONFIRMED


def winner(tmp_path, name: str) -> dict | None:
    import json

    return json.loads((tmp_path / name / "mesh_results.json").read_text())["best"]


def test_a_local_topology_compiles_in_full(own_tmp):
    """tune_mesh.early_stop stops XLA's TPU compile: on the devices present it compiles
    in full, as before."""
    got = plan(own_tmp, "local", "topology=cpu")
    assert {row["compile_mode"] for row in got.values()} == {"full"}
