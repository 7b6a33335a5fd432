"""Console script `capibara-exp`: compose the Hydra config and hand it to `experiment.run`.

Only Hydra, OmegaConf and the pure gin bridge are imported here, so `--help` and
`--cfg job` answer without loading JAX, TensorFlow or SeqIO.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from capibara_exp.gin_bridge import ConfigError
from capibara_exp.paths import CONF_DIR


def register_resolvers() -> None:
    """OmegaConf resolvers the shipped configs use."""
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda p: os.path.abspath(os.path.expanduser(p)))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from capibara_exp import experiment  # heavy imports start here

    try:
        experiment.run(cfg)
    except ConfigError as err:
        print(f"capibara-exp: configuration error: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    register_resolvers()
    _app()


if __name__ == "__main__":
    main()
