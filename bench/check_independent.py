"""The planner on MaxText's Llama 2/3 recipes for v5p and v6e, which it was never fitted on.

    python bench/check_independent.py --compile maxtext_v6e_llama3_8b   # compile (minutes each)
    python bench/check_independent.py                                   # the table from kept HLO

Each experiment of tuning/calibration.INDEPENDENT (conf/experiment/maxtext_v5p_*, _v6e_*) is
compiled for its slice under its own libtpu flags, each in its own process (libtpu reads its
flags once per process), and kept as bench/calibration/<experiment>.hlo.gz and .json. The
table: peak HBM per chip against what XLA lets a program use, the estimated MFU by MaxText's
FLOP count with the v5e-fitted constants and their leave-one-out error bar, and the
published MFU beside it. These points are reported, never fitted on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

from capibara_exp.base import topologies
from capibara_exp.tuning import calibration, profile
from capibara_exp.tuning.estimate import CALIBRATED, LEAVE_ONE_OUT_ERROR, estimate

NAMES = [p.experiment for p in calibration.INDEPENDENT]


def compile_one(name: str, where: Path) -> None:
    code = ("import sys; from pathlib import Path; from capibara_exp.base import environment; "
            "environment.select_platform(); environment.import_tensorflow(); "
            "from capibara_exp.tuning import calibration; "
            "r = calibration.compile_point(sys.argv[1], Path(sys.argv[2])); "
            "print(r['compile_s'], r['memory_bytes'])")
    done = subprocess.run([sys.executable, "-c", code, name, str(where)], capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    seconds, memory = map(float, done.stdout.split()[-2:])
    print(f"{name}: compiled in {seconds:.0f} s, {memory / 2**30:.2f} GiB per chip",
          file=sys.stderr, flush=True)


def row(point: calibration.Checked, where: Path) -> str | None:
    meta_path = where / f"{point.experiment}.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    chip = topologies.get(meta["topology"]).chip
    text = gzip.decompress((where / f"{point.experiment}.hlo.gz").read_bytes()).decode()
    step = profile.profile(text, meta["chips"], meta["device_coords"])
    est = estimate(step, chip, 1.0, CALIBRATED)
    mfu = meta["maxtext_flops"] / (est.step_s * chip.peak_flops)
    low, high = mfu * (1 - LEAVE_ONE_OUT_ERROR), mfu * (1 + LEAVE_ONE_OUT_ERROR)
    published = f"{point.mfu:.1%}" if point.mfu else "none"
    ratio = f"{mfu / point.mfu:.2f}" if point.mfu else "-"
    gib, usable = meta["memory_bytes"] / 2**30, chip.usable_hbm_bytes / 2**30
    return (f"| {point.experiment} | {meta['topology']} | {gib:.2f} of {usable:.2f} | "
            f"{est.step_s * 1e3:.0f} | {mfu:.1%} ({low:.1%}-{high:.1%}) | {published} | "
            f"{ratio} | {meta['compile_s']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", nargs="*", choices=NAMES, default=None)
    parser.add_argument("--dir", type=Path, default=calibration.DATA_DIR)
    args = parser.parse_args()
    for name in args.compile or []:
        compile_one(name, args.dir)
    print("| experiment | slice | GiB per chip (of XLA's) | est. step ms | est. MFU (error bar) "
          "| published MFU | est. / published | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for point in calibration.INDEPENDENT:
        line = row(point, args.dir)
        print(line or f"| {point.experiment} | not compiled: --compile {point.experiment} |")


if __name__ == "__main__":
    main()
