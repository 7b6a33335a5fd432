"""Console script `capibara-exp-meta`: compose conf/meta.yaml and run meta-consensus
(capibara_exp/meta_consensus.py): members composed and checked as `capibara-exp` would,
then trained in this process, gated, merged and evaluated."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from capibara_exp.cli import checks, guards
from capibara_exp.cli import compose as composing
from capibara_exp.cli.common import checked_argv, run_failed, user_errors
from capibara_exp.cli.shell import console
from capibara_exp.errors import RunError

PROG = "capibara-exp-meta"


def compose_member(overrides: list[str]) -> tuple[DictConfig, dict]:
    """One member's config as `capibara-exp <overrides>` composes and checks it."""
    from capibara_exp import config_check
    from capibara_exp.resolvers import register_resolvers

    register_resolvers()
    comp = composing.compose("config", overrides, [])
    config_check.check(comp)
    return checks.without_hydra(comp.cfg), dict(comp.choices)


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    line, comp, _ = checked_argv(PROG, "meta", sys.argv[1:] if argv is None else argv)
    if comp is None:  # --help and the like
        print(__doc__.strip() + "\nusage: capibara-exp-meta meta_consensus=<name> out=<dir> "
              "[meta_consensus.KEY=VALUE ...]  (conf/meta.yaml, conf/meta_consensus/)")
        return
    with user_errors(PROG, prefix="configuration error: "):
        guards.writable_dir("out", comp.cfg.out)
    from capibara_exp import phases

    phases.starting(PROG)
    with phases.importing():
        from capibara_exp import experiment, meta_consensus
    from capibara_exp.consensus.gate import ConsensusError

    def train(cfg: DictConfig, run_dir, choices: dict) -> None:
        experiment.run(cfg, run_dir, choices, multirun=True)

    try:
        with user_errors(PROG, ConsensusError, ValueError, FileNotFoundError):
            rep = meta_consensus.run(checks.without_hydra(comp.cfg), compose_member, train,
                                     experiment.say)
    except RunError as err:
        run_failed(PROG, err)
    for row in meta_consensus.summary_lines(rep):
        print(f"{PROG}: {row}", file=sys.stderr)


if __name__ == "__main__":
    main()
