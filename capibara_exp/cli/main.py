"""Console script `capibara-exp`: compose the Hydra config and hand it to `experiment.run`.

Only Hydra, OmegaConf and the pure gin bridge are imported here, so `--help` and
`--cfg job` answer without loading JAX, TensorFlow or SeqIO.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from capibara_exp.cli.common import (
    config_dirs,
    exit_on_bad_yaml,
    fail,
    register_resolvers,
    register_sweeper,
)
from capibara_exp.errors import ConfigError
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _app(cfg: DictConfig) -> dict | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from capibara_exp import experiment  # heavy imports start here

    try:
        return experiment.run(cfg)
    except ConfigError as err:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweeper records the job as failed and goes on
        fail(PROG, f"configuration error: {err}")


def main() -> None:
    exit_on_bad_yaml(PROG, config_dirs(sys.argv[1:]))
    register_resolvers()
    register_sweeper()
    _app()


if __name__ == "__main__":
    main()
