"""Merge throughput against this machine's memory copy bandwidth, measured in one run.

python bench/merge.py [--mb 64] [--n 8] [--reps 5] [--e2e-mb 128] [--no-e2e]

GB/s counts input read (N candidates x leaf bytes). The copy bandwidth is np.copyto of
the same N arrays into one warm buffer (GB/s read), measured right before and right
after every timed merge; each merge is compared with the mean of its two neighbours,
and the median over --reps is the figure (spread: min..max), so the shared machine's
drift cancels.

1. Aggregation as merge() runs it: the N leaves are fresh host arrays as the leaf
   reader returns them (no cached host copy of a jax.Array), the result goes into the
   first one's buffer (overwrite_input). Goals: >= 0.5 x copy for uniform/weighted,
   >= 0.25 x copy for median/trimmed mean; PASS/FAIL printed.
2. End to end: merge() over T5X-layout checkpoints on disk (page cache): TensorStore
   reads (Orbax stores zstd-compressed chunks: decoding bounds this), the gate, the
   aggregation, the Orbax write of the merged checkpoint and its manifest, each against
   TensorStore reading the same candidates alone. Goal: a gated merge (manifest digests,
   NaN/Inf, distance to the median) >= 0.7 x the reads alone; PASS/FAIL printed.
3. Krum's cost (Gram pass + solve) as N grows.
4. The methods that work on task vectors or interpolate (SLERP, Model Stock, DARE,
   Breadcrumbs, DELLA), one leaf of N candidates and a base as merge() calls them,
   against a NumPy baseline measured in the same run, interleaved: the plain task
   arithmetic of the same leaves (base + mean of x_i - base, in NumPy). The ratio is
   the method's time over the baseline's (how much the method's own work costs beyond
   reading and averaging the task vectors).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from capibara_exp.consensus import methods

GOALS = {"uniform": 0.5, "weighted": 0.5, "median": 0.25, "trimmed_mean": 0.25}
E2E_GOAL = 0.7  # a gated merge end to end, against TensorStore reading the same candidates


def copy_gbs(src: list[np.ndarray], dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    for x in src:
        np.copyto(dst, x)
    return sum(x.nbytes for x in src) / 1e9 / (time.perf_counter() - t0)


def interleaved(run: Callable[[], float], copy: Callable[[], float], reps: int,
                prepare: Callable[[], None] = lambda: None) -> tuple[list[float], list[float]]:
    """(ratios to copy, GB/s) per rep: copy, run, copy; `prepare` runs untimed first."""
    ratios, speeds = [], []
    for _ in range(reps):
        prepare()
        before = copy()
        gbs = run()
        after = copy()
        ratios.append(gbs / ((before + after) / 2))
        speeds.append(gbs)
    return ratios, speeds


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):5.2f} ({min(xs):.2f}..{max(xs):.2f})"


def aggregation(n: int, mb: int, reps: int, rng: np.random.Generator) -> bool:
    m = mb * (1 << 20) // 4
    pristine = [rng.standard_normal(m, dtype=np.float32) for _ in range(n)]
    leaves = [pristine[0].copy(), *pristine[1:]]  # leaves[0] takes the result: refreshed
    dst = np.empty_like(pristine[0])
    read_gb = n * pristine[0].nbytes / 1e9
    w = methods.uniform_weights(n)
    ramp = np.linspace(1.0, 2.0, n) / np.linspace(1.0, 2.0, n).sum()
    cases = {
        "uniform": lambda: methods.weighted_mean(leaves, w, overwrite_input=True),
        "weighted": lambda: methods.weighted_mean(leaves, ramp, overwrite_input=True),
        "median": lambda: methods.median(leaves, overwrite_input=True),
        "trimmed_mean": lambda: methods.trimmed_mean(leaves, 1, overwrite_input=True),
    }
    print(f"1. aggregation on the merge path ({n} fresh host leaves x {mb} MB, result into "
          f"the first), {reps} reps, median (min..max):")
    print(f"   {'method':14s} {'GB/s read':>22s} {'x copy':>22s}  goal")
    ok = True
    for name, fn in cases.items():
        fn()  # warm-up

        def timed(fn=fn) -> float:
            t0 = time.perf_counter()
            fn()
            return read_gb / (time.perf_counter() - t0)

        ratios, speeds = interleaved(timed, lambda: copy_gbs(pristine, dst), reps,
                                     prepare=lambda: np.copyto(leaves[0], pristine[0]))
        passed = statistics.median(ratios) >= GOALS[name]
        ok &= passed
        print(f"   {name:14s} {spread(speeds):>22s} {spread(ratios):>22s}  "
              f">= {GOALS[name]:.2f} {'PASS' if passed else 'FAIL'}")
    t0 = time.perf_counter()
    np.median(np.stack(pristine), axis=0)
    gbs = read_gb / (time.perf_counter() - t0)
    print(f"   {'np.median':14s} {gbs:16.2f} GB/s  (baseline, once)")
    return ok


def candidates(n: int, side: int, root: Path, rng: np.random.Generator) -> list:
    """n T5X-layout checkpoints of a decoder-like tree: two big matrices and a small leaf."""
    from capibara_exp.consensus import store
    from capibara_exp.runtime import checkpoints

    cands = []
    # Fine-tunes of one base (a soup of unrelated models is refused by the gate).
    base = {k: rng.standard_normal((side, side), dtype=np.float32) for k in ("wi", "wo")}
    for i in range(n):
        tree = {"target": {k: v + np.float32(0.01) * rng.standard_normal(v.shape,
                                                                           dtype=np.float32)
                           for k, v in base.items()} | {"scale": np.ones(side, np.float32)},
                "state": {"step": np.asarray(10, np.int32)}}
        mgr = checkpoints.manager(root / f"c{i}")
        checkpoints.save(mgr, 10, tree)
        mgr.close()
        cands.append(store.candidate_from_path(root / f"c{i}"))
    return cands


def end_to_end(n: int, mb: int, reps: int, rng: np.random.Generator) -> bool:
    from capibara_exp.consensus import store
    from capibara_exp.consensus.gate import GateConfig
    from capibara_exp.consensus.merge import MergeSpec, merge
    from capibara_exp.runtime import integrity

    side = int(np.sqrt(mb * (1 << 20) // 4 // 2))
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
        cands = candidates(n, side, Path(tmp), rng)
        read_gb = n * 2 * side * side * 4 / 1e9
        sample = [rng.standard_normal(side * side, dtype=np.float32) for _ in range(n)]
        dst = np.empty_like(sample[0])
        index = store.leaf_index(cands[0])
        print(f"2. end to end: merge() of {n} T5X-layout checkpoints x "
              f"{2 * side * side * 4 >> 20} MB on disk (page cache) into a new one, {reps} reps:")

        def reads_only() -> float:  # TensorStore reads and zstd decoding of every input leaf
            t0 = time.perf_counter()
            with store.LeafReader() as reader:
                for path, info in index.items():
                    reader.read_many(cands, path, info)
            return read_gb / (time.perf_counter() - t0)

        ratios, speeds = interleaved(reads_only, lambda: copy_gbs(sample, dst), reps)
        print(f"   {'reads only':32s} {spread(speeds):>22s} GB/s  {spread(ratios):>22s} x copy")
        print(f"   each merge below against TensorStore's reads alone (the rep before and after; "
              f"goal for the gated merges >= {E2E_GOAL} x reads):")
        # The shipped gate short of validation loss (manifest digests, NaN/Inf, distance to
        # the coordinate-wise median), then no gate at all on candidates without manifests.
        gates = {"shipped, no val loss": GateConfig(require_manifest=True,
                                                    max_val_loss_ratio=None),
                 "off, no manifests": GateConfig(require_manifest=False, check_finite=False,
                                                 max_val_loss_ratio=None,
                                                 max_distance_ratio=None, min_pass_fraction=0.0)}
        count, ok = [0], True
        for label, gate in gates.items():
            if not gate.require_manifest:
                for c in cands:
                    (c.step_dir / integrity.MANIFEST).unlink()
            for method in ("uniform", "median"):

                def timed(method=method, gate=gate) -> float:
                    count[0] += 1
                    t0 = time.perf_counter()
                    merge(cands, MergeSpec(method), Path(tmp) / f"out{count[0]}", None, gate)
                    return read_gb / (time.perf_counter() - t0)

                ratios, speeds = interleaved(timed, reads_only, reps)
                verdict = ""
                if gate.require_manifest:
                    passed = statistics.median(ratios) >= E2E_GOAL
                    ok &= passed
                    verdict = f"  >= {E2E_GOAL} {'PASS' if passed else 'FAIL'}"
                print(f"   {method:8s} gate {label:21s} {spread(speeds):>22s} GB/s  "
                      f"{spread(ratios):>22s} x reads{verdict}")
    return ok


def krum(rng: np.random.Generator) -> None:
    print("3. krum (Gram pass + solve), per N, 16 MB leaves:")
    small = 16 * (1 << 20) // 4
    for n in (4, 8, 16, 32):
        xs = [rng.standard_normal(small, dtype=np.float32) for _ in range(n)]
        gram = np.zeros((n, n))
        t0 = time.perf_counter()
        methods.gram_update(gram, xs)
        methods.krum_weights(gram, num_byzantine=max(0, (n - 3) // 3))
        s = time.perf_counter() - t0
        print(f"   N={n:3d}: {s * 1e3:8.1f} ms  ({n * small * 4 / 1e9 / s:5.2f} GB/s read)")


def task_vector_methods(n: int, mb: int, reps: int, rng: np.random.Generator) -> None:
    from capibara_exp.composing.merge_methods import MergeSpec
    from capibara_exp.consensus import base_merges, interpolate

    side = mb * (1 << 20) // 4 // 1024
    base = rng.standard_normal((side, 1024), dtype=np.float32)
    xs = [base + 0.01 * rng.standard_normal(base.shape, dtype=np.float32) for _ in range(n)]

    def baseline() -> float:
        t0 = time.perf_counter()
        base + np.mean(np.stack([x - base for x in xs]), axis=0)
        return time.perf_counter() - t0

    names = [f"c{i}" for i in range(n)]
    solved = {"names": names, "tv_weights": np.ones(n), "layer_position": {("w",): 0.5}}
    reader = type("Reader", (), {"read": lambda self, c, p, i: base})()
    runs = {"slerp (2)": lambda: interpolate.slerp(0.3, xs[0], xs[1]),
            "model_stock": lambda: interpolate.model_stock(xs, base)}
    for method in ("dare_ties", "dare_linear", "breadcrumbs", "della"):
        spec = MergeSpec(method, density=0.5)
        fn = base_merges.with_base(spec, solved, (reader, None, {("target", "w"): None}))
        runs[method] = lambda fn=fn: fn(("target", "w"), xs)
    print(f"4. task-vector and interpolating methods, {n} x {mb} MB leaves, vs NumPy task "
          "arithmetic of the same leaves (ratio: time / baseline's, median over reps):")
    for name, run in runs.items():
        ratios, secs = [], []
        for _ in range(reps):
            before = baseline()
            t0 = time.perf_counter()
            run()
            took = time.perf_counter() - t0
            ratios.append(took / ((before + baseline()) / 2))
            secs.append(took)
        print(f"   {name:12s} {statistics.median(secs) * 1e3:8.0f} ms  "
              f"{n * mb / 1e3 / statistics.median(secs):6.2f} GB/s read  "
              f"x {spread(ratios)} the baseline")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="MB per candidate leaf")
    ap.add_argument("--n", type=int, default=8, help="candidates")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--e2e-mb", type=int, default=128, help="MB per candidate checkpoint")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--task-vectors-only", action="store_true",
                    help="only part 4 (SLERP, Model Stock, DARE, Breadcrumbs, DELLA)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.task_vectors_only:
        task_vector_methods(args.n, min(args.mb, 16), args.reps, rng)
        return
    ok = aggregation(args.n, args.mb, args.reps, rng)
    e2e = True
    if not args.no_e2e:
        e2e = end_to_end(args.n, args.e2e_mb, args.reps, rng)
    krum(rng)
    task_vector_methods(args.n, min(args.mb, 16), args.reps, rng)
    print(f"goals: {'PASS' if ok else 'FAIL'} (aggregation on the merge path vs copy), "
          f"{'PASS' if e2e else 'FAIL'} (gated merges vs TensorStore's reads)")


if __name__ == "__main__":
    main()
