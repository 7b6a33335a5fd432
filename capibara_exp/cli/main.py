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

from capibara_exp.cli import checks
from capibara_exp.cli.common import (
    checked_argv,
    fail,
    register_sweeper,
    run_failed,
    user_errors,
)
from capibara_exp.errors import ConfigError, RunError
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
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


def main(argv: list[str] | None = None) -> None:
    line, comp, hydra_argv = checked_argv(PROG, "config", sys.argv[1:] if argv is None else argv)
    if comp is not None:
        with user_errors(PROG, prefix="configuration error: "):
            checks.check_run(comp, line)
    sys.argv = [sys.argv[0], *hydra_argv]
    register_sweeper()
    _app()


if __name__ == "__main__":
    main()
