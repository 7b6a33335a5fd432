"""The mesh planner's step-time model against MaxText's published v5e results.

    python bench/calibrate.py              # refit from the kept HLO (seconds)
    python bench/calibrate.py --compile    # compile the four configurations first (v5e-256)

For MaxText's 16B, 32B, 64B and 128B configurations (conf/experiment/maxtext_v5e_*.yaml)
compiled for one v5e-256 slice (bench/calibration/<experiment>.hlo.gz and .json, written
by --compile: each compile takes 1-4 minutes and 2-3 GB of host memory, one at a time):
the estimated MFU with the datasheet constants, the constants fitted on all four points,
and leave-one-out (fit on three, predict the fourth), against the published MFU. PASS when
every leave-one-out estimate is within 15% (relative) of the published MFU, and the
constants the planner ships (tuning/estimate.py FITTED) are the ones this fit gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from capibara_exp.base import topologies
from capibara_exp.tuning import calibration


def compile_points(where: Path) -> None:
    """Compile each published configuration for its slice and keep its HLO and metadata."""
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
    lines, _ = calibration.report(calibration.load_points(args.dir), chip)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
