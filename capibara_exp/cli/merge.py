"""Console script `capibara-exp-merge`: compose conf/merge.yaml and call
`consensus.command.run_merge`."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from capibara_exp import environment
from capibara_exp.cli.common import checked_argv, user_errors
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp-merge"


@hydra.main(config_path=str(CONF_DIR), config_name="merge", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from capibara_exp.consensus import command
    from capibara_exp.consensus.gate import ConsensusError

    with user_errors(PROG, ConsensusError, ValueError, FileNotFoundError):
        rep = command.run_merge(cfg)
    for line in command.console_lines(rep):
        print(f"{PROG}: {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    _, comp, hydra_argv = checked_argv(PROG, "merge", sys.argv[1:] if argv is None else argv)
    if comp is not None:  # a merge, not --help: TensorFlow (seqio's) without its notices
        environment.import_tensorflow()
    sys.argv = [sys.argv[0], *hydra_argv]
    _app()


if __name__ == "__main__":
    main()
