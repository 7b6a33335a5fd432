"""Console script `capibara-exp`: check the command line, then let Hydra run `experiment.run`.

Before Hydra starts the job (and makes its run dir), the command line is composed and
checked (cli/checks.py): a mistake is one line and exit status 2 with nothing written. Once
it composes and its values check (Hydra alone, a second), the first line says so,
`capibara-exp: starting (engine=...)`, before the rest of the checks load TensorFlow, JAX
and SeqIO (a mistake found there follows that line). `--help` and `--cfg job` answer
without loading JAX, TensorFlow or SeqIO. The run dir is checked (a writable directory),
locked for this process, and removed again if the run is refused before it starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from capibara_exp.cli.shell import console, job

PROG = "capibara-exp"


def kept(argv: list[str]) -> str:
    """What a stopped or failed run left: the newest checkpoint of the model_dir it names."""
    named = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("model_dir=")]
    if not named or not named[-1].strip():
        return "nothing of earlier runs was touched"
    run_dir = Path(named[-1])
    steps = sorted(int(p.name.split("_")[1]) for p in run_dir.glob("checkpoint_*")
                   if p.name.split("_")[1].isdigit()) if run_dir.is_dir() else []
    return (f"kept {run_dir}/checkpoint_{steps[-1]} (its newest checkpoint)" if steps else
            f"no checkpoint of {run_dir} was written")


@console(PROG, kept)
def main(argv: list[str] | None = None) -> None:
    from capibara_exp.cli import light_exit
    from capibara_exp.cli.common import checked_argv, register_sweeper, user_errors

    light_exit.light(True)  # until a run's checks or Hydra's app start (light_exit.py)
    line, comp, hydra_argv = checked_argv(PROG, "config", sys.argv[1:] if argv is None else argv)
    from capibara_exp.cli import help as app_help

    if comp is None and app_help.wants_help(line):  # Hydra's text, without Hydra's wait
        with user_errors(PROG, prefix="configuration error: "):
            print(app_help.render("config", line))
        return
    if comp is not None:
        light_exit.light(line.shows_config and not line.multirun)  # a run loads TF, JAX
        check_paths(comp, line)
        from capibara_exp.cli import checks

        def starting() -> None:
            # Composed, its values, paths and gin flags checked (a second): the first line,
            # before the rest of the checks import TensorFlow, JAX and SeqIO. A mistake
            # found before it stays one line.
            if not line.shows_config:
                from capibara_exp.base import phases

                sweep = " (a sweep)" if line.multirun else ""
                phases.starting(PROG, f" (engine={comp.cfg.engine.name}){sweep}")

        # Hydra's text from this composition (not composed twice), from the copy without
        # its hydra node that the checks take next (not copied twice)
        copy = checks.without_hydra(comp.cfg)
        shown = app_help.job_config(copy) if app_help.plain_job_config(line) else None
        with user_errors(PROG, prefix="configuration error: "):
            checks.check_run(comp, line, starting, copy)
        if shown is not None:
            sys.stdout.write(shown)
            return
    light_exit.light(False)  # Hydra's app: its job, its launchers, its log files
    sys.argv = [sys.argv[0], *hydra_argv]
    register_sweeper()
    if comp is None or not _writes_here(comp, line):
        _app()
        return
    from capibara_exp.cli import guards

    run_dir = comp.cfg.get("model_dir") or comp.cfg.hydra.run.dir
    with guards.undone_if_refused(run_dir):
        hold_run_dir(comp, line)
        _app()


def _writes_here(comp, line) -> bool:
    """A run of this machine (not a sweep, --cfg, or a TPU VM launch on shared storage)."""
    return not (line.multirun or line.shows_config or comp.cfg.engine.name == "tpu_vm")


def _locks(comp) -> bool:
    """Whether this process takes the run dir's lock: the processes of one multi-process run
    share their run dir, so only its process 0 does (none where the index is known only
    after jax.distributed starts, distributed.mode=auto)."""
    dist = comp.cfg.distributed
    return dist.mode == "single" or (dist.mode == "explicit" and not dist.process_id)


def check_paths(comp, line) -> None:
    """The run dir is a directory this process can write (or make); the data dir one it
    can read (or make)."""
    if not _writes_here(comp, line):
        return
    from capibara_exp.base import run_lock
    from capibara_exp.cli import guards
    from capibara_exp.cli.common import user_errors

    run_dir = comp.cfg.get("model_dir") or comp.cfg.hydra.run.dir
    with user_errors(PROG, prefix="configuration error: "):
        guards.writable_dir("model_dir", run_dir)
        guards.dir_or_creatable("data_dir", comp.cfg.data_dir)  # built data may be read-only
        if _locks(comp):
            run_lock.refuse_if_held(run_dir)  # taken later, just before the run starts


def hold_run_dir(comp, line) -> None:
    """The run dir, locked for this process, before Hydra writes its first file there."""
    if not (_writes_here(comp, line) and _locks(comp)):
        return
    from capibara_exp.base import run_lock
    from capibara_exp.cli.common import user_errors

    run_dir = comp.cfg.get("model_dir") or comp.cfg.hydra.run.dir
    with user_errors(PROG, prefix="configuration error: "):
        note = run_lock.hold(run_dir)
    if note:
        print(f"{PROG}: {note}", file=sys.stderr)


def _app() -> None:
    """Hydra's app around `_run`, built here so that importing this module imports nothing."""
    import hydra

    from capibara_exp.base.paths import CONF_DIR

    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(job(_run))()


def _run(cfg):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from capibara_exp import experiment  # heavy imports start here
    from capibara_exp.base.errors import ConfigError, RunError
    from capibara_exp.cli.common import fail, run_failed

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        return experiment.run(cfg, Path(hc.runtime.output_dir), dict(hc.runtime.choices),
                              multirun)
    except (ConfigError, RunError) as err:
        if multirun:
            raise  # the sweeper records the job as failed and goes on
        if isinstance(err, RunError):
            run_failed(PROG, err)
        fail(PROG, f"configuration error: {err}")


if __name__ == "__main__":
    main()
