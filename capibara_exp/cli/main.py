"""Console script `capibara-exp`: check the command line, then let Hydra run `experiment.run`.

Before Hydra starts the job (and makes its run dir), the command line is composed and
checked (cli/checks.py): a mistake is one line and exit status 2 with nothing written.
`--help` and `--cfg job` answer without loading JAX, TensorFlow or SeqIO.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from capibara_exp.cli import checks, guards
from capibara_exp.cli.common import (
    checked_argv,
    fail,
    register_sweeper,
    run_failed,
    user_errors,
)
from capibara_exp.cli.shell import console, job
from capibara_exp.errors import ConfigError, RunError
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@job
def _app(cfg: DictConfig) -> dict | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from capibara_exp import experiment  # heavy imports start here

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


def _writes_here(comp, line) -> bool:
    """A run of this machine (not a sweep, --cfg, or a TPU VM launch on shared storage)."""
    return not (line.multirun or line.shows_config or comp.cfg.engine.name == "tpu_vm")


def check_paths(comp, line) -> None:
    """The run dir is a directory this process can write (or make); the data dir one it
    can read (or make)."""
    if not _writes_here(comp, line):
        return
    with user_errors(PROG, prefix="configuration error: "):
        guards.writable_dir("model_dir", comp.cfg.get("model_dir") or comp.cfg.hydra.run.dir)
        guards.dir_or_creatable("data_dir", comp.cfg.data_dir)  # built data may be read-only


def hold_run_dir(comp, line) -> None:
    """The run dir, locked for this process, before Hydra writes its first file there."""
    if not _writes_here(comp, line):
        return
    run_dir = comp.cfg.get("model_dir") or comp.cfg.hydra.run.dir
    with user_errors(PROG, prefix="configuration error: "):
        from capibara_exp import run_lock

        note = run_lock.hold(run_dir)
    if note:
        print(f"{PROG}: {note}", file=sys.stderr)


@console(PROG, kept)
def main(argv: list[str] | None = None) -> None:
    line, comp, hydra_argv = checked_argv(PROG, "config", sys.argv[1:] if argv is None else argv)
    if comp is not None:
        check_paths(comp, line)
        with user_errors(PROG, prefix="configuration error: "):
            checks.check_run(comp, line)
    sys.argv = [sys.argv[0], *hydra_argv]
    register_sweeper()
    if comp is None or not _writes_here(comp, line):
        _app()
        return
    run_dir = comp.cfg.get("model_dir") or comp.cfg.hydra.run.dir
    with guards.undone_if_refused(run_dir):
        hold_run_dir(comp, line)
        _app()


if __name__ == "__main__":
    main()
