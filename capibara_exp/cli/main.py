"""Console script `capibara-exp`: check the command line, then let Hydra run `experiment.run`.

Before Hydra starts the job (and makes its run dir), the command line is composed and
checked (cli/checks.py): a mistake is one line and exit status 2 with nothing written. Once
it composes and its values check (Hydra alone, a second), the first line says so,
`capibara-exp: starting (engine=...)`, before the rest of the checks load TensorFlow, JAX
and SeqIO (a mistake found there follows that line). `--help` and `--cfg job` answer
without loading JAX, TensorFlow or SeqIO.
"""

from __future__ import annotations

import sys

PROG = "capibara-exp"


def main(argv: list[str] | None = None) -> None:
    from capibara_exp.cli.common import checked_argv, register_sweeper, user_errors

    line, comp, hydra_argv = checked_argv(PROG, "config", sys.argv[1:] if argv is None else argv)
    from capibara_exp.cli import help as app_help

    if comp is None and app_help.wants_help(line):  # Hydra's text, without Hydra's wait
        with user_errors(PROG, prefix="configuration error: "):
            print(app_help.render("config", line))
        return
    if comp is not None:
        # Composed and its values checked (Hydra only): the first line, before the rest of
        # the checks import TensorFlow, JAX and SeqIO. A compose-time mistake stays one line.
        if not line.shows_config:
            sweep = " (a sweep)" if line.multirun else ""
            print(f"{PROG}: starting (engine={comp.cfg.engine.name}){sweep} ...",
                  file=sys.stderr, flush=True)
        from capibara_exp.cli import checks

        with user_errors(PROG, prefix="configuration error: "):
            checks.check_run(comp, line)
        if app_help.plain_job_config(line):  # Hydra's text from this composition: not twice
            sys.stdout.write(app_help.job_config(comp.cfg))
            return
    sys.argv = [sys.argv[0], *hydra_argv]
    register_sweeper()
    _app()


def _app() -> None:
    """Hydra's app around `_run`, built here so that importing this module imports nothing."""
    import hydra

    from capibara_exp.paths import CONF_DIR

    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_run)()


def _run(cfg):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from capibara_exp import experiment
    from capibara_exp.cli.common import fail, run_failed
    from capibara_exp.errors import ConfigError, RunError

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        return experiment.run(cfg, hc.runtime.output_dir, dict(hc.runtime.choices), multirun)
    except (ConfigError, RunError) as err:
        if multirun:
            raise  # the sweeper records the job as failed and goes on
        if isinstance(err, RunError):
            run_failed(PROG, err)
        fail(PROG, f"configuration error: {err}")


if __name__ == "__main__":
    main()
