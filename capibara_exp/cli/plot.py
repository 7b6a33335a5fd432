"""Console script `capibara-exp-plot RUN_DIR [--out PNG] [--overwrite]`: a run's curves from
metrics.jsonl, rendered to a PNG (./<RUN_DIR's name>_curves.png by default: the run dir is
only read); prints the PNG's path. An existing PNG is replaced only with --overwrite."""

from __future__ import annotations

import argparse
from pathlib import Path

from capibara_exp.cli import guards
from capibara_exp.cli.common import fail, user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-plot"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        fail(PROG, f"{message} (usage: {PROG} RUN_DIR [--out PNG] [--overwrite])")


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run dir (model_dir) with metrics.jsonl")
    parser.add_argument("--out", help="PNG path (default ./<RUN_DIR's name>_curves.png)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    args = parser.parse_args(argv)
    with user_errors(PROG):
        run_dir = guards.existing_input("RUN_DIR", args.run_dir)
        if not run_dir.is_dir():
            fail(PROG, f"RUN_DIR={run_dir}: not a directory (a run dir with metrics.jsonl)")
        name = Path(run_dir.absolute()).name or "run"
        out = guards.new_file("--out", args.out if args.out is not None
                              else f"{name}_curves.png", {"RUN_DIR": run_dir})
        if _inside(out, run_dir):
            fail(PROG, f"--out {out}: inside the run dir {run_dir}, which is only read; "
                       "name a file elsewhere")
        if out.exists() and not args.overwrite:
            fail(PROG, f"--out {out}: exists; --overwrite replaces it")
        if not (run_dir / "metrics.jsonl").is_file():  # (plots.render says so too, later)
            fail(PROG, f"no metrics.jsonl in {run_dir}")
    from capibara_exp.base import phases
    from capibara_exp.cli import run_curves

    phases.starting(PROG)  # before matplotlib loads (plots.render imports it)
    with user_errors(PROG), phases.phase("drawing the curves (matplotlib)"):
        print(run_curves.render(run_dir, out))


def _inside(path: Path, directory: Path) -> bool:
    return Path(directory).resolve() in Path(path).resolve().parents


if __name__ == "__main__":
    main()
