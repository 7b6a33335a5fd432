"""Console script `capibara-exp-meta`: compose conf/meta.yaml and run meta-consensus
(capibara_exp/consensus/meta_consensus.py): members composed and checked as `capibara-exp` would,
then trained in this process, gated, merged and evaluated."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from capibara_exp.base.errors import ConfigError, RunError
from capibara_exp.cli import checks, guards
from capibara_exp.cli import compose as composing
from capibara_exp.cli.common import checked_argv, run_failed, user_errors
from capibara_exp.cli.shell import console, job

PROG = "capibara-exp-meta"


def compose_member(overrides: list[str]) -> tuple[DictConfig, dict]:
    """One member's config as `capibara-exp <overrides>` composes and checks it."""
    from capibara_exp.composing import config_check
    from capibara_exp.composing.resolvers import register_resolvers

    register_resolvers()
    comp = composing.compose("config", overrides, [])
    config_check.check(comp)
    return checks.without_hydra(comp.cfg), dict(comp.choices)


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    line, comp, hydra_argv = checked_argv(PROG, "meta", sys.argv[1:] if argv is None else argv)
    if comp is None or line.shows_config:  # --help, --cfg, --info: Hydra's answers
        sys.argv = [sys.argv[0], *hydra_argv]
        _app()
        return
    with user_errors(PROG, prefix="configuration error: "):
        guards.writable_dir("out", comp.cfg.out)
    from capibara_exp.base import phases

    phases.starting(PROG)
    with phases.importing():
        from capibara_exp import experiment
        from capibara_exp.consensus import meta_consensus
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


def _app() -> None:
    """Hydra's app for conf/meta.yaml: it answers --help, --hydra-help, --info and --cfg
    (the run itself composes its members and trains them in this process, outside Hydra's
    job: it never reaches `_not_a_job`)."""
    import hydra

    from capibara_exp.base.paths import CONF_DIR

    hydra.main(config_path=str(CONF_DIR), config_name="meta",
               version_base="1.3")(job(_not_a_job))()


def _not_a_job(cfg: DictConfig) -> None:
    del cfg
    raise ConfigError("--experimental-rerun: capibara-exp-meta keeps no Hydra job to rerun; "
                      "run the same command again (finished members are not trained again)")


if __name__ == "__main__":
    main()
