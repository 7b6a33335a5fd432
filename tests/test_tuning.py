"""The mesh planner: search space, Optuna search, memory pruning, outputs, the CLI.

The HLO profile, the step-time model and its calibration: tests/test_step_model.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from capibara_exp.base import topologies
from capibara_exp.tuning import mesh_space, search, tpu_slice
from tests.conftest import needs_libtpu


def memory_bounds(overrides: list[str], devices: list, cands: list) -> dict:
    """tuning/memory.py's lower bound of each candidate of the composed experiment."""
    import gin
    from capibara_exp.tuning import aot, evaluator, memory
    from tests.conftest import compose_config

    cfg = compose_config(overrides)
    try:
        shapes = memory.shapes_of(aot.train_bindings(aot.render_local_gin(cfg), devices),
                                  cfg.model)
    finally:
        gin.clear_config(clear_constants=True)
    moe = "num_experts" in cfg.model
    return {c: memory.lower_bound(shapes, c, evaluator.rules_for(c, moe)) for c in cands}


def tpu_devices(name: str = "v5e-4") -> list:
    assert tpu_slice.libtpu_installed(), tpu_slice.INSTALL_HINT  # installed by the test extra
    return tpu_slice.devices(topologies.get(name))


def test_candidates_divide_the_chips_heads_experts_and_batch():
    cands = mesh_space.candidates(64, num_heads=16, num_experts=32, batch_size=256,
                             num_microbatches=[1, 4], remat_policies=["dots"], fsdp=[False, True])
    assert cands and len(set(cands)) == len(cands)
    for c in cands:
        assert c.data * c.expert * c.model == 64
        assert 16 % c.model == 0 and 32 % c.expert == 0
        assert (256 // c.num_microbatches) % (c.data * c.expert) == 0
        assert not (c.fsdp and c.data == 1)
    assert {c.mesh for c in cands} >= {"2x32x1", "64x1x1", "8x8x1", "4x8x2"}
    dense = mesh_space.candidates(8, num_heads=4, num_experts=None, batch_size=16)
    assert {c.mesh for c in dense} == {"8x1x1", "4x1x2", "2x1x4"}  # 8 model partitions: 4 heads
    with pytest.raises(ValueError, match="tune_mesh.remat_policies: 'some'"):
        mesh_space.candidates(8, 4, None, 16, remat_policies=["some"])


def test_attention_is_searched_where_the_model_can_take_splash():
    from capibara_exp.base.errors import ConfigError
    from capibara_exp.tuning import plan
    from tests.conftest import compose_config

    def attentions(*overrides, local=False):
        return plan.attentions(compose_config(["+tune_mesh=default", *overrides]), local)

    rope = ["model.position_embedding=rope", "data.task_feature_lengths={targets: 512}"]
    assert attentions() == ["dot"]  # relative position bias: no splash
    assert attentions(*rope) == ["dot", "splash"]
    assert attentions(*rope, local=True) == ["dot"]  # off TPU splash is dot
    assert attentions("model.position_embedding=rope",  # a length the blocks do not divide
                      "data.task_feature_lengths={targets: 200}") == ["dot"]
    with pytest.raises(ConfigError, match="lists splash, which this model cannot take: "
                                          "model.position_embedding=relative"):
        attentions("tune_mesh.attentions=[splash]")
    with pytest.raises(ConfigError, match="'flash' is not one of"):
        attentions(*rope, "tune_mesh.attentions=[flash]")
    both = mesh_space.candidates(8, 4, None, 16, attentions=["dot", "splash"])
    assert len(both) == 2 * len(mesh_space.candidates(8, 4, None, 16))
    assert {c.attention for c in both} == {"dot", "splash"}
    assert "model.attention=splash" in both[-1].overrides(moe=False)


def _table(cands):
    """A synthetic result per candidate: a clear optimum, some infeasible."""
    table = {}
    for i, c in enumerate(cands):
        feasible = not (c.model == 1 and c.num_microbatches == 1)
        value = 0.1 + 0.01 * (i % 7) + (0.5 if c.mesh == "2x1x4" and c.fsdp else 0.0)
        table[c] = search.Result(c, {"feasible": feasible, "est_mfu": value,
                                     "reason": "" if feasible else "out of HBM: test"})
    return table


def test_search_finds_the_optimum_and_resumes(tmp_path):
    import optuna

    from capibara_exp.tuning import evaluator as evaluate_module

    cands = mesh_space.candidates(8, num_heads=4, num_experts=None, batch_size=16,
                             num_microbatches=[1, 2], remat_policies=["none", "full"],
                             fsdp=[False, True])
    table = _table(cands)
    compiled = []

    def evaluate(cand):
        compiled.append(cand)
        return evaluate_module.done(table[cand].record)

    cache = search.Cache(tmp_path / "candidates.jsonl")
    best_exhaustive = search.best(search.exhaustive(cands, cache, evaluate))
    assert best_exhaustive.candidate.mesh == "2x1x4" and best_exhaustive.candidate.fsdp
    assert len(compiled) == len(cands)
    # A second process reads the cache: nothing compiles again.
    again = search.Cache(tmp_path / "candidates.jsonl")
    assert search.best(search.exhaustive(cands, again, evaluate)).candidate == \
        best_exhaustive.candidate
    assert len(compiled) == len(cands)

    storage = f"sqlite:///{tmp_path / 'study.db'}"

    def study():
        return optuna.create_study(study_name="s", storage=storage, load_if_exists=True,
                                   direction="maximize",
                                   sampler=search.mesh_sampler("tpe", 0, 40))

    fresh = search.Cache(None)
    def records(cand):
        return evaluate_module.done(table[cand].record)

    first = search.optimize(cands, fresh, records, 12, study())
    trials = study().trials
    assert search.told(study()) == 12
    infeasible = [t for t in trials if t.system_attrs.get("constraints:infeasible")]
    assert all(t.value == 0.0 for t in infeasible)
    more = search.optimize(cands, fresh, records, 20, study())
    assert search.told(study()) == 20 and more[:len(first)] == first
    found = search.compiles_to_optimum(cands, table, "tpe", [0, 1, 2], max_trials=60)
    assert all(n is not None and 1 <= n <= len(cands) for n in found)


def test_a_stopped_planners_running_trial_is_failed_and_the_search_goes_on(tmp_path):
    """The planner's own study in its output dir: a re-run fails the trial a stopped planner
    left RUNNING (its compile is gone) and tells trials up to the new n_trials."""
    from omegaconf import OmegaConf
    from optuna.trial import TrialState

    from capibara_exp.base import optuna_study
    from capibara_exp.tuning import evaluator as evaluate_module
    from capibara_exp.tuning import plan

    cands = mesh_space.candidates(8, num_heads=4, num_experts=None, batch_size=16,
                             num_microbatches=[1, 2], remat_policies=["none", "full"],
                             fsdp=[False, True])
    table = _table(cands)
    cfg = OmegaConf.create({"name": "tiny", "topology": "v5e-8", "tune_mesh": {
        "search": "tpe", "seed": 0, "n_trials": 6, "max_compiles": None}})

    def records(cand):
        return evaluate_module.done(table[cand].record)

    first, replay = plan.search_space(cfg, cands, search.Cache(None), records, 1, tmp_path)
    assert replay is None and first
    opened = optuna_study.load(optuna_study.open_storage(f"sqlite:///{tmp_path / plan.STUDY_DB}"),
                               "mesh:tiny:v5e-8")
    stopped = optuna_study.ask(opened.study)  # what a planner killed mid-compile leaves
    assert opened.trial(stopped.number).state == TrialState.RUNNING
    cfg.tune_mesh.n_trials = 9
    plan.search_space(cfg, cands, search.Cache(None), records, 1, tmp_path)
    states = [t.state for t in opened.study.trials]
    assert states[stopped.number] == TrialState.FAIL and TrialState.RUNNING not in states
    assert search.told(opened.study) == 9


def test_a_pooled_search_compiles_each_candidate_once(tmp_path):
    """Three trials at a time on a pool whose results come back out of order: each candidate
    is compiled at most once, every trial is told, and every compile is cached."""
    import concurrent.futures
    import random
    import time

    import optuna

    cands = mesh_space.candidates(8, num_heads=4, num_experts=None, batch_size=16,
                             num_microbatches=[1, 2], remat_policies=["none", "full"],
                             fsdp=[False, True])
    table = _table(cands)
    submitted = []
    jitter = random.Random(0)

    def slow(cand):
        submitted.append(cand)
        delay = jitter.uniform(0, 0.02)
        return workers.submit(lambda: time.sleep(delay) or table[cand].record)

    with concurrent.futures.ThreadPoolExecutor(3) as workers:
        pooled = search.Cache(tmp_path / "pooled.jsonl")
        study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'pooled.db'}",
                                    direction="maximize",
                                    sampler=search.mesh_sampler("tpe", 1, 30))
        got = search.optimize(cands, pooled, slow, 30, study, workers=3)
    assert search.told(study) == 30 and 0 < len(got) <= 30  # invalid combinations yield none
    assert len(submitted) == len(set(submitted)) == len(pooled.results)
    assert len(search.Cache(tmp_path / "pooled.jsonl").results) == len(pooled.results)


def test_a_search_starts_no_compile_after_its_budget(tmp_path, monkeypatch):
    """On a clock each compile moves on by 10 s, a 25 s budget admits three compiles (the
    third starts at 20 s), exhaustive and TPE alike; cached results are still returned."""
    import optuna

    from capibara_exp.tuning import evaluator as evaluate_module

    cands = mesh_space.candidates(8, num_heads=4, num_experts=None, batch_size=16,
                             num_microbatches=[1, 2], remat_policies=["none", "full"],
                             fsdp=[False, True])
    table, clock, compiled = _table(cands), [0.0], []
    monkeypatch.setattr(search.time, "monotonic", lambda: clock[0])

    def evaluate(cand):
        compiled.append(cand)
        clock[0] += 10.0
        return evaluate_module.done(table[cand].record)

    cache = search.Cache(tmp_path / "candidates.jsonl")
    got = search.exhaustive(cands, cache, evaluate, workers=1, deadline=25.0)
    assert [r.candidate for r in got] == cands[:3] == compiled
    # Past the budget: the three cached results come back, nothing compiles.
    again = search.exhaustive(cands, cache, evaluate, workers=1, deadline=25.0)
    assert [r.candidate for r in again] == cands[:3] and len(compiled) == 3
    compiled.clear()
    clock[0] = 0.0
    study = optuna.create_study(direction="maximize", sampler=search.mesh_sampler("tpe", 0, 20))
    search.optimize(cands, search.Cache(None), evaluate, 20, study, deadline=25.0)
    assert len(compiled) == 3 and search.told(study) >= 3


@needs_libtpu
def test_tune_mesh_writes_report_and_a_partitioning_entry_that_runs(tmp_path):
    assert tpu_slice.libtpu_installed(), tpu_slice.INSTALL_HINT
    conf = tmp_path / "conf"
    out = subprocess.run(
        [sys.executable, "-m", "capibara_exp.cli.tune_mesh", "topology=v5e-4",
         "tune_mesh.search=exhaustive", "tune_mesh.replay_seeds=2",
         "tune_mesh.num_microbatches=[1,2]", "tune_mesh.remat_policies=[none]",
         "tune_mesh.fsdp=[false]", "model.num_layers=1", f"tune_mesh.conf_dir={conf}",
         "hydra.run.dir=plan"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "plan" / "mesh_results.json").read_text())
    # 4 chips, 4 heads: meshes 4x1, 2x2, 1x4; batch 16 splits 2 microbatches on each.
    assert results["space_size"] == 6 and results["compiled"] == 6
    assert results["feasible"] == 6 and len(results["tpe_compiles_to_optimum"]) == 2
    for row in results["results"]:
        assert row["memory_bytes"] > 0 and row["est_step_s"] > 0 and 0 < row["est_mfu"] < 1
        assert row["flops"] >= 0.9 * row["model_flops"]  # executed >= model FLOPs (no remat)
    best = results["best"]
    assert best["est_mfu"] == max(r["est_mfu"] for r in results["results"])
    # Each compile keeps its HLO; results of an older profiler are re-read, not recompiled.
    from capibara_exp.tuning import plan

    cache = search.Cache(tmp_path / "plan" / plan.CACHE)
    assert all((tmp_path / "plan" / r.record["hlo_file"]).exists() for r in cache.results.values())
    first = next(iter(cache.results.values()))
    want = dict(first.record)
    first.record.update(profile_version=0, est_step_s=-1.0)
    assert plan.reprofile(cache, tmp_path / "plan", 4, topologies.V5E) == 1
    assert first.record == want
    # Without its HLO, an older profiler's result is dropped, to be compiled again.
    first.record.update(profile_version=0)
    (tmp_path / "plan" / first.record["hlo_file"]).unlink()
    assert plan.reprofile(cache, tmp_path / "plan", 4, topologies.V5E) == 0
    assert first.candidate not in search.Cache(tmp_path / "plan" / plan.CACHE).results
    assert (tmp_path / "plan" / "mesh_report.png").stat().st_size > 10_000
    assert "| mesh data x expert x model |" in (tmp_path / "plan" / "mesh_report.md").read_text()
    entry = conf / "partitioning" / "dense_tiny_lm_v5e_4.yaml"
    assert entry.read_text().startswith("# @package _global_")
    # The entry composes with capibara-exp as written (partitioner, trainer and model keys).
    job = subprocess.run([sys.executable, "-m", "capibara_exp.cli", "--config-dir", str(conf),
                          "partitioning=dense_tiny_lm_v5e_4", "--cfg", "job"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    import yaml

    composed = yaml.safe_load(job.stdout)
    mesh = best["candidate"].split()[0].removeprefix("mesh=").split("x")
    assert composed["partitioning"]["num_partitions"] == int(mesh[2])
    mb = int(best["candidate"].split()[1].removeprefix("mb="))
    assert composed["trainer"]["num_microbatches"] == (mb if mb > 1 else None)
    # The memory bound the planner prunes by is below what every compile needed.
    bound = memory_bounds(["topology=v5e-4", "model.num_layers=1"], tpu_devices("v5e-4"),
                          list(cache.results))
    for cand, result in cache.results.items():
        assert 0 < bound[cand] <= result.record["memory_bytes"], cand.key


@pytest.mark.slow
def test_measured_mode_times_candidates_on_simulated_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run(
        [sys.executable, "-m", "capibara_exp.cli.tune_mesh", "topology=cpu",
         "tune_mesh.search=exhaustive", "tune_mesh.replay_seeds=1", "tune_mesh.measure=true",
         "tune_mesh.measure_steps=2", "tune_mesh.num_microbatches=[1,2]", "model.num_layers=1",
         "tune_mesh.remat_policies=[none]", "tune_mesh.fsdp=[false]",
         f"tune_mesh.conf_dir={tmp_path / 'conf'}", "hydra.run.dir=plan"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "plan" / "mesh_results.json").read_text())
    assert results["devices"] == "2 local cpu devices"
    assert results["compiled"] == 4  # 2x1x1 and 1x1x2, 1 or 2 microbatches
    assert all(r["measured_step_s"] > 0 for r in results["results"])
    agreement = results["measured_vs_estimated"]
    assert agreement["candidates"] == 4 and -1.0 <= agreement["spearman"] <= 1.0
    assert "measured vs estimated" in (tmp_path / "plan" / "mesh_report.md").read_text().lower()


def test_candidates_over_the_memory_bound_cost_no_compile(tmp_path):
    """A budget no step fits (a reserve of all 15.75 GiB XLA allows on v5e): every
    candidate is ruled out by tuning/memory.py's bound, recorded infeasible without
    compiling, and the run says no candidate is feasible."""
    out = subprocess.run(
        [sys.executable, "-m", "capibara_exp.cli.tune_mesh", "topology=v5e-4",
         "tune_mesh.search=exhaustive", "tune_mesh.hbm_reserve_gib=15.75",
         f"tune_mesh.conf_dir={tmp_path / 'conf'}", "hydra.run.dir=plan"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no feasible candidate" in out.stderr
    results = json.loads((tmp_path / "plan" / "mesh_results.json").read_text())
    assert results["pruned"] == results["evaluated"] == results["space_size"] > 0
    assert results["compiled"] == results["feasible"] == 0
    for row in results["results"]:
        assert row["pruned"] and row["compile_s"] == 0.0 and "hlo_file" not in row
        assert "over HBM before compiling" in row["reason"]
    assert not (tmp_path / "plan" / "hlo").exists()


def test_tune_mesh_errors(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "capibara_exp.cli.tune_mesh", *args,
                               "hydra.run.dir=plan"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    out = run("topology=v9-1")  # refused when the command line is checked, before the planner
    assert out.returncode == 2 and "topology=v9-1 (set by the command line): expected cpu, " \
        "a TPU slice (v4-8 ... v4-512, v5e-1" in out.stderr and not (tmp_path / "plan").exists()
    out = run("topology=v5e-4", "tune_mesh.measure=true")
    assert out.returncode == 2 and "not attached here" in out.stderr
    out = run("topology=v5e-4", "tune_mesh.model_partitions=[3]")
    assert out.returncode == 2 and "no mesh candidate fits" in out.stderr
