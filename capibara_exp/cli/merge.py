"""Console script `capibara-exp-merge`: compose conf/merge.yaml and call
`consensus.command.run_merge`."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from capibara_exp import environment, phases
from capibara_exp.cli import guards
from capibara_exp.cli.common import checked_argv, user_errors
from capibara_exp.cli.shell import console, job
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp-merge"


@hydra.main(config_path=str(CONF_DIR), config_name="merge", version_base="1.3")
@job
def _app(cfg: DictConfig) -> None:
    from capibara_exp.consensus import command
    from capibara_exp.consensus.gate import ConsensusError

    with user_errors(PROG, ConsensusError, ValueError, FileNotFoundError):
        rep = command.run_merge(cfg)
    for line in command.console_lines(rep):
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


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    line, comp, hydra_argv = checked_argv(PROG, "merge", sys.argv[1:] if argv is None else argv)
    if comp is not None and not line.shows_config:
        with user_errors(PROG, prefix="configuration error: "):
            check_paths(comp.cfg)
    if comp is not None and not line.shows_config:  # a merge, not --help or --cfg:
        phases.starting(PROG)  # TensorFlow (seqio's) without its notices
        with phases.importing("TensorFlow"):
            environment.import_tensorflow()
    sys.argv = [sys.argv[0], *hydra_argv]
    if comp is None or line.shows_config:
        _app()
        return
    # a merge that failed (a full disk: exit 1) or was stopped (75) leaves no half-written
    # checkpoint in its out dir either: nothing there is of use, and out must be new or empty
    with guards.undone_if_refused(comp.cfg.out, codes=(1, 2, 75)):
        _app()


if __name__ == "__main__":
    main()
