"""Mesh planner benchmark: AOT compile time per candidate for moe_e2b_base on v5e:8x8, and
how many compiles TPE needs to reach the optimum of a space small enough to enumerate.

    python bench/tune_mesh.py                      # both parts (tens of minutes on 2 cores)
    python bench/tune_mesh.py --skip-base          # only the enumerable space
    python bench/tune_mesh.py --base-candidates 3  # more moe_e2b_base compiles

Part 1 runs `capibara-exp-tune-mesh experiment=moe_e2b_base` on a few candidates and prints
each compile's wall time and the planner's own peak host memory. Part 2 enumerates
dense_tiny_lm's space on v5e-8 (every mesh, microbatch count, remat policy and FSDP choice),
then replays fresh TPE and random-sampler studies on the compiled results, many seeds each:
compiles until the optimum is first met, against the size of the space. Both parts keep
their compiles in the run dirs (candidates.jsonl), so a re-run compiles nothing again.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from capibara_exp.tuning import search
from capibara_exp.tuning.space import Candidate

TUNE = [sys.executable, "-m", "capibara_exp.cli.tune_mesh"]


def tune(out: Path, *args: str) -> dict:
    cmd = [*TUNE, *args, f"hydra.run.dir={out}", f"tune_mesh.conf_dir={out / 'conf'}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    peak_kb = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    results = json.loads((out / "mesh_results.json").read_text())
    results["peak_host_gib"] = peak_kb / 2**20
    return results


def base_compile_times(out: Path, candidates: int) -> None:
    # The first `candidates` shapes of a small slice of moe_e2b_base's space: expert axes
    # 32, 16 and 8 (data 2, 4, 8), no microbatching, the shipped remat.
    experts = [32, 16, 8, 4][:candidates]
    results = tune(out, "experiment=moe_e2b_base", "tune_mesh.search=exhaustive",
                   "tune_mesh.replay_seeds=1", "tune_mesh.model_partitions=[1]",
                   f"tune_mesh.expert_partitions=[{','.join(map(str, experts))}]",
                   "tune_mesh.num_microbatches=[1]", "tune_mesh.remat_policies=[dots]",
                   "tune_mesh.fsdp=[false]")
    print(f"moe_e2b_base on {results['devices']}: {results['space_size']} candidates compiled "
          f"(planner process peak host memory {results['peak_host_gib']:.1f} GiB)")
    for row in results["results"]:
        status = (f"{row['memory_bytes'] / 2**30:.2f} GiB/chip, est {row['est_step_s'] * 1e3:.0f} "
                  f"ms, MFU {row['est_mfu']:.1%}" if row["feasible"] else row["reason"][:80])
        print(f"  {row['candidate']}: compile {row['compile_s']:.0f} s; {status}")
    times = [r["compile_s"] for r in results["results"] if r["compile_s"]]
    print(f"  median compile {statistics.median(times):.0f} s per candidate")


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
          f"exhaustive compile time {compile_s:.0f} s; optimum {best.candidate.key} "
          f"(est MFU {best.value:.2%})")
    for sampler in ("tpe", "random"):
        found = search.compiles_to_optimum(cands, table, sampler, list(range(seeds)),
                                           max_trials=len(cands) * 4)
        hits = [n for n in found if n is not None]
        median = statistics.median(hits) if hits else float("nan")
        print(f"  {sampler:6s}: optimum reached in {len(hits)}/{seeds} seeds; median "
              f"{median:.0f} compiles = {median / len(cands):.2f} of exhaustive "
              f"(quartiles {statistics.quantiles(hits, n=4) if len(hits) > 1 else hits})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_tune_mesh"))
    parser.add_argument("--base-candidates", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--skip-base", action="store_true")
    args = parser.parse_args()
    if not args.skip_base:
        base_compile_times(args.out / "moe_e2b_base", args.base_candidates)
    trials_to_optimum(args.out / "dense_tiny_v5e_8", args.seeds)


if __name__ == "__main__":
    main()
