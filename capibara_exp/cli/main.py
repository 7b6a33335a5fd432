"""Console script `capibara-exp`: check the command line, then let Hydra run `experiment.run`.

Its first line comes before anything heavy is imported (Hydra included): `capibara-exp:
starting (engine=...)`. Before Hydra starts the job (and makes its run dir), the command
line is composed and checked (cli/checks.py): a mistake is one line and exit status 2 with
nothing written. `--help` and `--cfg job` answer without loading JAX, TensorFlow or SeqIO.
"""

from __future__ import annotations

import re
import sys

PROG = "capibara-exp"
# Hydra's flags that answer without running: no starting line for them.
INFORMING = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version",
             "--shell-completion", "-sc", "--resolve")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    engine = announce(args)
    from capibara_exp.cli.common import checked_argv, register_sweeper, user_errors

    line, comp, hydra_argv = checked_argv(PROG, "config", args)
    if comp is not None:
        from capibara_exp.cli import checks

        with user_errors(PROG, prefix="configuration error: "):
            checks.check_run(comp, line)
        composed = comp.cfg.engine.name
        if engine is not None and composed != engine:  # an experiment file chose it
            print(f"{PROG}: engine={composed} (set by the config)", file=sys.stderr, flush=True)
    sys.argv = [sys.argv[0], *hydra_argv]
    register_sweeper()
    _hydra_app()()


def announce(args: list[str]) -> str | None:
    """The first line, within a moment of the command's start: which engine will train (as
    the command line says; `main` corrects it once the config is composed). None for flags
    that only inform."""
    if any(a.split("=")[0] in INFORMING for a in args):
        return None
    engine = "local"
    for arg in args:
        found = re.fullmatch(r"\+*engine=(\w+)", arg)
        engine = found.group(1) if found else engine
    sweep = " (a sweep)" if any(a in ("-m", "--multirun") for a in args) else ""
    print(f"{PROG}: starting (engine={engine}){sweep} ...", file=sys.stderr, flush=True)
    return engine


def _hydra_app():
    """Hydra's app around `_run`, built here so that importing this module imports nothing."""
    import hydra

    from capibara_exp.paths import CONF_DIR

    return hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_run)


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
