"""Console script `capibara-exp-merge`: compose conf/merge.yaml and call
`consensus.command.run_merge`."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from capibara_exp.cli import app, guards
from capibara_exp.cli.common import user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-merge"


def _merge(cfg: DictConfig) -> None:
    from capibara_exp.consensus import merge_command
    from capibara_exp.consensus.gate import ConsensusError

    with user_errors(PROG, ConsensusError, ValueError, FileNotFoundError):
        rep = merge_command.run_merge(cfg)
    for line in merge_command.console_lines(rep):
        print(f"{PROG}: {line}", file=sys.stderr)


def check_paths(cfg: DictConfig) -> None:
    """Every input exists, and `out` is new or empty and overlaps none of them: checked
    before Hydra makes `out` (and writes out/.merge_hydra there)."""
    runs = [cfg.runs] if isinstance(cfg.runs, str) else list(cfg.runs or [])
    inputs = {f"runs[{i}]": guards.existing_input(f"runs[{i}]", r) for i, r in enumerate(runs)}
    for key in ("base", "eval_config"):
        if cfg.get(key) is not None:
            inputs[key] = guards.existing_input(key, cfg[key])
    start = cfg.fedavg.get("initial_checkpoint")
    if cfg.method == "fedavg" and start is not None:
        inputs["fedavg.initial_checkpoint"] = guards.existing_input(
            "fedavg.initial_checkpoint", start)
    guards.new_output("out", cfg.out, inputs)


_app = app.hydra_app("merge", _merge)


def _undone_if_refused(cfg: DictConfig):
    # a merge that failed (a full disk: exit 1) or was stopped (75) leaves no half-written
    # checkpoint in its out dir either: nothing there is of use, and out must be new or empty
    return guards.undone_if_refused(cfg.out, codes=(1, 2, 75))


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    app.run(PROG, "merge", sys.argv[1:] if argv is None else argv, lambda: _app(),
            check=check_paths, tensorflow=True, around=_undone_if_refused)


if __name__ == "__main__":
    main()
