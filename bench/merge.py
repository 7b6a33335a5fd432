"""Merge throughput against this machine's memory copy bandwidth, measured in one run.

python bench/merge.py [--mb 256] [--n 8]
Input read = N candidates x leaf bytes; ratio = merge GB/s / np.copyto GB/s (reads).
Goals: >= 0.5 for uniform/weighted, >= 0.25 for median/trimmed mean. Also Krum's cost
(Gram pass + solve) as N grows.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from capibara_exp.consensus import methods
from capibara_exp.kernels import robust_agg


def best_of(fn, repeats: int = 3) -> float:
    fn()  # warm-up: the first np.asarray of a jax.Array copies it (later ones reuse the copy)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="MB per candidate leaf")
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    m = args.mb * (1 << 20) // 4
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(m, dtype=np.float32) for _ in range(args.n)]
    leaves = [jax.device_put(x) for x in host]
    dst = np.empty_like(host[0])
    copy_s = best_of(lambda: [np.copyto(dst, x) for x in host])
    read_gb = args.n * host[0].nbytes / 1e9
    copy_gbs = read_gb / copy_s
    print(f"memory copy (np.copyto, {args.n} x {args.mb} MB): {copy_gbs:.2f} GB/s read")
    w = methods.uniform_weights(args.n)
    cases = {
        "uniform": lambda: methods.weighted_mean(leaves, w),
        "weighted": lambda: methods.weighted_mean(leaves, np.linspace(1, 2, args.n) / np.linspace(
            1, 2, args.n).sum()),
        "median": lambda: methods.median(leaves),
        "trimmed_mean": lambda: methods.trimmed_mean(leaves, 1),
        # The kernels alone on host arrays: the rest of a merge step is the jax.Array
        # round trip (device_put of the merged leaf into a fresh buffer).
        "uniform, kernel only": lambda: robust_agg.weighted_sum_of(host, list(w)),
        "median, kernel only": lambda: robust_agg.nanmedian_of(host),
        "np.median (baseline)": lambda: np.median(np.stack(host), axis=0),
    }
    for name, fn in cases.items():
        s = best_of(lambda f=fn: jax.block_until_ready(f()), repeats=2)
        print(f"{name:22s} {read_gb / s:6.2f} GB/s  = {read_gb / s / copy_gbs:5.2f} x copy")
    # In a merge every leaf is a fresh jax.Array, so the first host view is a copy.
    for name in ("uniform", "median"):
        fresh = [jax.device_put(x) for x in host]
        jax.block_until_ready(fresh)
        fn = (lambda: methods.weighted_mean(fresh, w)) if name == "uniform" else (
            lambda: methods.median(fresh))
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        s = time.perf_counter() - t0
        print(f"{name + ' (fresh arrays)':22s} {read_gb / s:6.2f} GB/s  = "
              f"{read_gb / s / copy_gbs:5.2f} x copy")
    print("krum (Gram pass + solve), per N, 16 MB leaves:")
    small = 16 * (1 << 20) // 4
    for n in (4, 8, 16, 32):
        xs = [jax.device_put(rng.standard_normal(small, dtype=np.float32)) for _ in range(n)]

        def krum(xs=xs, n=n):
            gram = np.zeros((n, n))
            methods.gram_update(gram, xs)
            return methods.krum_weights(gram, num_byzantine=max(0, (n - 3) // 3))
        s = best_of(krum, repeats=1)
        print(f"  N={n:3d}: {s * 1e3:8.1f} ms  ({n * small * 4 / 1e9 / s:5.2f} GB/s read)")


if __name__ == "__main__":
    main()
