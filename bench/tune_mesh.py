"""Mesh planner benchmark: what a planner run costs for moe_e2b_base on v5e:8x8, how many
compiles TPE needs to reach the optimum of a space small enough to enumerate, and the
step-time model against MaxText's published v5e results.

    python bench/tune_mesh.py                       # all three parts (tens of minutes)
    python bench/tune_mesh.py --skip-base           # parts 2 and 3
    python bench/tune_mesh.py --base-trials 40      # a longer moe_e2b_base study

Part 1 runs `capibara-exp-tune-mesh experiment=moe_e2b_base` (TPE, the compile pool sized
to this host's cores, candidates over the memory bound pruned without compiling) and
prints the wall time per compiled candidate against the median time of one compile in the
same run (goal: at most 90 s per candidate). Part 2 enumerates dense_tiny_lm's space on
v5e-8 (every mesh, microbatch count, remat policy and FSDP choice), then replays fresh TPE
and random-sampler studies on the compiled results, many seeds each: compiles until the
optimum is first met, against the size of the space (goal: TPE's median at most 0.25).
Part 3 prints bench/calibrate.py's table. Parts 1 and 2 keep their compiles in the run
dirs (candidates.jsonl), so a re-run compiles nothing again and measures nothing new:
pass --fresh to time part 1 again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from capibara_exp.base import topologies
from capibara_exp.tuning import calibration, search
from capibara_exp.tuning.mesh_space import Candidate

TUNE = [sys.executable, "-m", "capibara_exp.cli.tune_mesh"]
COMPILE_GOAL_S = 90.0
TPE_GOAL = 0.25


def tune(out: Path, *args: str) -> dict:
    cmd = [*TUNE, *args, f"hydra.run.dir={out}", f"tune_mesh.conf_dir={out / 'conf'}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    results = json.loads((out / "mesh_results.json").read_text())
    results["wall_s"] = time.perf_counter() - start
    results["peak_host_gib"] = max(before, resource.getrusage(
        resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    return results


def base_planner_run(out: Path, trials: int, fresh: bool) -> None:
    if fresh and out.exists():
        shutil.rmtree(out)
    load = os.getloadavg()[0]
    results = tune(out, "experiment=moe_e2b_base", f"tune_mesh.n_trials={trials}")
    rows = results["results"]
    compiled = [r for r in rows if not r.get("pruned")]
    pruned = len(rows) - len(compiled)
    feasible = [r for r in compiled if r["feasible"]] or compiled
    single = statistics.median(r["compile_s"] for r in feasible)
    cpu = statistics.median(r.get("compile_cpu_s", float("nan")) for r in feasible)
    per_candidate = results["wall_s"] / max(len(compiled), 1)
    print(f"moe_e2b_base on {results['devices']} ({results['space_size']} candidates; load "
          f"average {load:.1f} at the start): TPE met {len(rows)} distinct candidates in "
          f"{trials} trials: {len(compiled)} compiled, {pruned} pruned by the memory bound; "
          f"planner wall time {results['wall_s']:.0f} s, peak host memory of the planner "
          f"process {results['peak_host_gib']:.1f} GiB (workers not included)")
    for row in rows[:8]:
        status = (f"{row['memory_bytes'] / 2**30:.2f} GiB/chip, est {row['est_step_s'] * 1e3:.0f}"
                  f" ms, MFU {row['est_mfu']:.1%}" if row["feasible"] else row["reason"][:70])
        print(f"  {row['candidate']}: compile {row.get('compile_s', 0):.0f} s; {status}")
    verdict = "PASS" if per_candidate <= COMPILE_GOAL_S else "FAIL"
    print(f"  one compile (median of the feasible ones): {single:.0f} s wall, {cpu:.0f} s of CPU; "
          f"planner wall time per compiled candidate {per_candidate:.0f} s "
          f"({single / per_candidate:.2f}x one at a time); goal <= {COMPILE_GOAL_S:.0f} s: "
          f"{verdict}")
    if results.get("best"):
        print(f"  best: {results['best']['candidate']}, est MFU {results['best']['est_mfu']:.1%}")


def trials_to_optimum(out: Path, seeds: int) -> None:
    results = tune(out, "experiment=dense_tiny_lm", "topology=v5e-8",
                   "tune_mesh.search=exhaustive", "tune_mesh.replay_seeds=1",
                   "tune_mesh.num_microbatches=[1,2,4]",
                   "tune_mesh.remat_policies=[none,dots,full]", "tune_mesh.fsdp=[false,true]")
    cache = search.Cache(out / "candidates.jsonl")
    cands = sorted(cache.results)
    table: dict[Candidate, search.Result] = dict(cache.results)
    best = search.best(list(table.values()))
    compile_s = sum(r.record.get("compile_s", 0.0) for r in table.values())
    print(f"\ndense_tiny_lm on v5e-8: {len(cands)} candidates, {results['feasible']} feasible, "
          f"compile time {compile_s:.0f} s in all; optimum {best.candidate.key} "
          f"(est MFU {best.value:.2%})")
    for sampler in ("tpe", "random"):
        found = search.compiles_to_optimum(cands, table, sampler, list(range(seeds)),
                                           max_trials=len(cands) * 4)
        counts = [n if n is not None else len(cands) for n in found]  # a miss costs them all
        median = statistics.median(counts)
        verdict = (f"; goal <= {TPE_GOAL}: {'PASS' if median / len(cands) <= TPE_GOAL else 'FAIL'}"
                   if sampler == "tpe" else "")
        print(f"  {sampler:6s}: optimum reached in {sum(n is not None for n in found)}/{seeds} "
              f"seeds; median {median:.0f} compiles = {median / len(cands):.2f} of exhaustive "
              f"(quartiles {statistics.quantiles(counts, n=4)}){verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_tune_mesh"))
    parser.add_argument("--base-trials", type=int, default=24)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--skip-base", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="recompile part 1's candidates")
    args = parser.parse_args()
    if not args.skip_base:
        base_planner_run(args.out / "moe_e2b_base", args.base_trials, args.fresh)
    trials_to_optimum(args.out / "dense_tiny_v5e_8", args.seeds)
    print()
    lines, _ = calibration.report(calibration.load_points(), topologies.get("v5e-256").chip)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
