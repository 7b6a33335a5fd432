"""Where one mesh candidate's compile time goes (issue 27, item 6).

    python bench/compile_cost.py                       # the default variants, one process each
    python bench/compile_cost.py --variants base dot   # some of them
    python bench/compile_cost.py --dump                # also per-pass HLO dumps (slower)
    python bench/compile_cost.py --early --variants base  # full compile vs early stop

One candidate of the Llama 3.1 8B entry (conf/model/llama3_8b.yaml) at sequence 8,192 on
v6e-256: one sequence per chip, FSDP over all chips, full remat, splash attention, scanned
layers. Each variant runs in its own process (a fresh libtpu, its own flags) and prints, in
the same run: the time to build the step (gin, shapes), to lower it (jax.jit(...).lower:
tracing and the splash kernels' Mosaic lowering), to compile it (XLA's SPMD partitioner and
TPU backend passes, Mosaic's kernel compile), the compile's CPU time and the process's peak
RSS, and the figures the planner ranks by (peak HBM per chip, estimated step and MFU), so a
variant that compiles faster can be checked to keep them. Ratios are against `base`.

With --early, each variant is also compiled the planner's early-stop way
(tuning/early.py: a child process killed once XLA has dumped the optimized HLO and buffer
assignment); the table adds its wall and CPU time (child start-up and lowering included),
the ratio of the full compile's wall time to it, whether the profile and estimate are the
full compile's, and its memory figure (the buffer assignment's) beside XLA's peak.

With --dump, XLA writes the module after every HLO pass that changed it under
<out>/dump/<variant>; the gaps between the files' modification times say how long the
passes between them took (bench prints the 12 largest spans).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

BASE = ["model=llama3_8b", "topology=v6e-256", "partitioning=fsdp",
        "data.task_feature_lengths={targets: 8192}", "data.batch_size=256",
        "model.remat_policy=full", "model.attention=splash", "model.scan_layers=true"]

NO_VLIW = "--xla_jf_vliw_scheduler=false --xla_jf_critical_path_scheduler=false"
SMALL = ["model.num_layers=2", "data.task_feature_lengths={targets: 2048}", "topology=v6e-8",
         "data.batch_size=8"]
VARIANTS: dict[str, dict] = {
    "base": {},
    "dot": {"overrides": ["model.attention=dot"]},
    "v6e-8": {"overrides": ["topology=v6e-8", "data.batch_size=8"]},  # same per-chip shapes
    "layers2": {"overrides": ["model.num_layers=2"]},
    "seq2048": {"overrides": ["data.task_feature_lengths={targets: 2048}"]},
    "no_lhs": {"libtpu": "--xla_tpu_enable_latency_hiding_scheduler=false"},
    # The same candidate with the TPU backend's (LLO) instruction schedulers off: they run
    # after buffer assignment, on the program the figures are read from.
    "no_vliw": {"libtpu": NO_VLIW},
    "llo0": {"libtpu": "--xla_jf_llo_level=0"},
    # A small stand-in (2 layers, 2,048 tokens, 8 chips) to compare flags quickly.
    "small": {"overrides": SMALL},
    "small_no_vliw": {"overrides": SMALL, "libtpu": NO_VLIW},
    "small_llo0": {"overrides": SMALL, "libtpu": "--xla_jf_llo_level=0"},
    "small_vocab32k": {"overrides": [*SMALL, "model.vocab_size=32000"]},
    "small_seq512": {"overrides": [*SMALL, "data.task_feature_lengths={targets: 512}"]},
    "small_1layer_dot": {"overrides": [*SMALL, "model.num_layers=1", "model.attention=dot"]},
}


def _early(cfg, full_fields: dict) -> dict:
    """The early-stop compile of the same candidate (its own child process), against the
    full compile's profile fields."""
    from capibara_exp.base import topologies
    from capibara_exp.tuning import early

    got = early.compile_step(cfg, cfg.topology, topologies.get(cfg.topology).chip)
    keep = ("flops", "hbm_bytes", "collective_bytes", "est_step_s", "est_mfu")
    return {"early_s": got.compile_s, "early_cpu_s": got.compile_cpu_s,
            "early_xla_s": got.profiled.get("xla_until_dumps_s", float("nan")),
            "early_peak_gib": got.memory_bytes / 2**30, "early_reason": got.reason,
            "early_same_profile": all(got.profiled.get(k) == full_fields[k] for k in keep)}


def child(name: str, overrides: list[str], libtpu: str | None, early: bool = False) -> dict:
    """Build, lower and compile one candidate here; its figures."""
    from hydra import compose, initialize_config_dir

    from capibara_exp.base import environment, topologies
    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.cli.common import register_resolvers
    from capibara_exp.tuning import aot
    from capibara_exp.tuning import tpu_slice as topology

    environment.select_platform()
    environment.import_tensorflow()
    register_resolvers()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model_dir=/tmp/capibara-model", *BASE, *overrides])
    topo = topologies.get(cfg.topology)
    t0 = time.perf_counter()
    devices = topology.devices(topo, libtpu)
    import gin
    from capibara_exp.runtime import state as run_state

    t1 = time.perf_counter()
    bindings = aot.train_bindings(aot.render_local_gin(cfg), devices)
    t2 = time.perf_counter()
    lowered = run_state.lower_train_step(**bindings)
    t3 = time.perf_counter()
    model_flops = aot.model_flops_per_chip(bindings, len(devices))
    coords = aot.mesh_coords(bindings["partitioner"].mesh)
    gin.clear_config(clear_constants=True)
    hlo_chars = len(lowered.as_text())
    cpu0 = time.process_time()
    t4 = time.perf_counter()
    compiled = lowered.compile()
    t5 = time.perf_counter()
    cpu = time.process_time() - cpu0
    fields = aot.profile_fields(compiled.as_text(), len(devices), topo.chip, model_flops, coords)
    row = {"variant": name, "devices_s": t1 - t0, "build_s": t2 - t1, "lower_s": t3 - t2,
            "compile_s": t5 - t4, "compile_cpu_s": cpu, "stablehlo_chars": hlo_chars,
            "peak_gib": aot.memory_per_chip(compiled) / 2**30,
            "est_step_ms": fields["est_step_s"] * 1e3, "est_mfu": fields["est_mfu"],
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if early:
        del compiled, lowered  # the early child's compile runs alone
        row.update(_early(cfg, fields))
    return row


def pass_spans(dump: Path, top: int = 12) -> list[tuple[float, str]]:
    """(seconds, file) for the largest gaps between consecutive dumped passes."""
    files = sorted(dump.glob("*.txt"), key=lambda p: p.stat().st_mtime)
    spans = [(b.stat().st_mtime - a.stat().st_mtime, b.name)
             for a, b in zip(files, files[1:], strict=False)]
    return sorted(spans, reverse=True)[:top]


def run_variant(name: str, out: Path, dump: bool, nice: int, early: bool = False) -> dict:
    env = dict(os.environ)
    if dump:
        where = out / "dump" / name
        where.mkdir(parents=True, exist_ok=True)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={where}"
                            " --xla_dump_hlo_pass_re=.*"
                            " --xla_dump_hlo_module_re=jit__step").strip()
    cmd = ["nice", "-n", str(nice), sys.executable, __file__, "--child", name,
           *(["--early"] if early else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        return {"variant": name, "error": done.stderr.strip().splitlines()[-1:]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if dump:
        row["spans"] = pass_spans(out / "dump" / name)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["base", "dot", "v6e-8"],
                        choices=sorted(VARIANTS))
    parser.add_argument("--dump", action="store_true")
    parser.add_argument("--early", action="store_true")
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_compile_cost"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = VARIANTS[args.child]
        print(json.dumps(child(args.child, spec.get("overrides", []), spec.get("libtpu"),
                               args.early)))
        return
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = []
    for name in args.variants:
        row = run_variant(name, args.out, args.dump, args.nice, args.early)
        rows.append(row)
        print(json.dumps(row), f"load {os.getloadavg()[0]:.2f}", flush=True)
    base = next((r for r in rows if r["variant"] == "base" and "error" not in r), None)
    print("\nvariant    lower_s  compile_s  cpu_s  x base  peak GiB  est ms  est MFU  RSS GiB")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:10} error: {r['error']}")
            continue
        ratio = r["compile_s"] / base["compile_s"] if base else float("nan")
        print(f"{r['variant']:10} {r['lower_s']:7.1f} {r['compile_s']:10.1f} "
              f"{r['compile_cpu_s']:6.1f} {ratio:7.2f} {r['peak_gib']:9.2f} "
              f"{r['est_step_ms']:7.1f} {r['est_mfu']:8.1%} {r['rss_gib']:8.2f}")
        if "early_s" in r:
            print(f"    early stop: {r['early_s']:.1f} s wall, {r['early_cpu_s']:.1f} s CPU "
                  f"(start-up and lowering included; XLA until the dumps "
                  f"{r['early_xla_s']:.1f} s), full/early wall "
                  f"{r['compile_s'] / r['early_s']:.1f}x, CPU "
                  f"{r['compile_cpu_s'] / r['early_cpu_s']:.1f}x; same profile and estimate: "
                  f"{r['early_same_profile']}; memory {r['early_peak_gib']:.2f} GiB (buffer "
                  f"assignment) vs peak {r['peak_gib']:.2f} GiB {r['early_reason']}")
        for span, what in r.get("spans", []):
            print(f"    {span:7.1f} s before {what}")


if __name__ == "__main__":
    main()
