"""The mesh planner's step-time model against MaxText's published v5e results.

    python bench/calibrate.py              # refit from the kept HLO (seconds)
    python bench/calibrate.py --compile    # compile the four configurations first (v5e-256)

For MaxText's 16B, 32B, 64B and 128B configurations (conf/experiment/maxtext_v5e_*.yaml)
compiled for one v5e-256 slice (bench/calibration/<experiment>.hlo.gz and .json, written
by --compile: each compile takes 1-4 minutes and 2-3 GB of host memory, one at a time):
the estimated MFU with the datasheet constants, the constants fitted on all four points,
and leave-one-out (fit on three, predict the fourth), against the published MFU. PASS when
every leave-one-out estimate is within 15% (relative) of the published MFU, and the
constants the planner ships (tuning/calibration.py FITTED) are the ones this fit gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from capibara_exp import topologies
from capibara_exp.tuning import calibration
from capibara_exp.tuning.estimate import DATASHEET

GOAL = 0.15


def compile_points(where: Path) -> None:
    """Compile each published configuration for its slice and keep its HLO and metadata."""
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    for point in calibration.PUBLISHED:
        print(f"compiling {point.experiment} for v5e-256 ...", file=sys.stderr, flush=True)
        record = calibration.compile_point(point.experiment, where)
        print(f"  {record['compile_s']:.0f} s, {record['memory_bytes'] / 2**30:.2f} GiB per chip",
              file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile the four first")
    parser.add_argument("--dir", type=Path, default=calibration.DATA_DIR)
    args = parser.parse_args()
    if args.compile:
        compile_points(args.dir)
    chip = topologies.get("v5e-256").chip
    points = calibration.load_points(args.dir)
    fitted = calibration.fit(points, chip)
    loo = calibration.leave_one_out(points, chip)
    print(f"Published: {calibration.SOURCE}\n")
    print("| configuration | published MFU | est. datasheet | est. fitted on all 4 | "
          "leave-one-out est. | leave-one-out error |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for point, _, predicted in loo:
        error = predicted / point.published.mfu - 1
        worst = max(worst, abs(error))
        print(f"| {point.published.experiment} | {point.published.mfu:.1%} | "
              f"{point.estimated_mfu(chip, DATASHEET):.1%} | "
              f"{point.estimated_mfu(chip, fitted):.1%} | {predicted:.1%} | {error:+.1%} |")
    print("\nConstants fitted on all four (tuning/calibration.py FITTED):")
    for name in calibration.FIT_PARAMETERS:
        loo_values = ", ".join(f"{getattr(m, name):.3f}" for _, m, _ in loo)
        print(f"  {name} = {getattr(fitted, name):.3f} (leave-one-out fits: {loo_values}; "
              f"shipped {calibration.FITTED[name]:.3f})")
    shipped = all(abs(calibration.FITTED[n] - getattr(fitted, n)) < 5e-3
                  for n in calibration.FIT_PARAMETERS)
    ok = worst <= GOAL and shipped
    print(f"\nworst leave-one-out error {worst:.1%} (goal <= {GOAL:.0%}); shipped constants "
          f"{'match' if shipped else 'DIFFER from'} the fit: {'PASS' if ok else 'FAIL'}")
    print(f"Fitted model: {dataclasses.asdict(fitted)}")


if __name__ == "__main__":
    main()
