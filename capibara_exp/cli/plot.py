"""Console script `capibara-exp-plot RUN_DIR [--out PNG]`: a run's curves from metrics.jsonl,
rendered to a PNG (RUN_DIR/curves.png by default); prints the PNG's path."""

from __future__ import annotations

import argparse
from pathlib import Path

from capibara_exp.cli.common import user_errors

PROG = "capibara-exp-plot"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run dir (model_dir) with metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    from capibara_exp import plots

    with user_errors(PROG):
        print(plots.render(args.run_dir, args.out or args.run_dir / "curves.png"))


if __name__ == "__main__":
    main()
