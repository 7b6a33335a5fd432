"""Console script `capibara-exp`: compose the Hydra config and hand it to `experiment.run`.

Only Hydra, OmegaConf and the pure gin bridge are imported here, so `--help` and
`--cfg job` answer without loading JAX, TensorFlow or SeqIO.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from capibara_exp.gin_bridge import ConfigError
from capibara_exp.paths import CONF_DIR, SWEEPS_ROOT


def register_resolvers() -> None:
    """OmegaConf resolvers the shipped configs use."""
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda p: os.path.abspath(os.path.expanduser(p)))
    if not OmegaConf.has_resolver("capibara_sweeps_root"):
        OmegaConf.register_new_resolver("capibara_sweeps_root", lambda: str(SWEEPS_ROOT))


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
        print(f"capibara-exp: configuration error: {err}", file=sys.stderr)
        sys.exit(2)


def _config_dirs(argv: list[str]) -> list[Path]:
    dirs = [CONF_DIR]
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
    return dirs


def check_yaml(dirs: list[Path]) -> str | None:
    """One line naming the file, line and problem of the first malformed YAML file, if any."""
    import yaml

    for root in dirs:
        for path in sorted(Path(root).rglob("*.yaml")):
            try:
                yaml.safe_load(path.read_text())
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
                problem = getattr(err, "problem", None) or str(err)
                return f"{where}: malformed YAML: {problem}"
    return None


def register_sweeper() -> None:
    """The capibara_optuna sweeper, also where Hydra's scan of hydra_plugins cannot see it
    (an editable install's import hook hides the directory from that scan)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.capibara_optuna_sweeper.capibara_optuna_sweeper import (
        CapibaraOptunaSweeper,
    )

    Plugins.instance().register(CapibaraOptunaSweeper)


def main() -> None:
    problem = check_yaml(_config_dirs(sys.argv[1:]))
    if problem:
        print(f"capibara-exp: configuration error: {problem}", file=sys.stderr)
        sys.exit(2)
    register_resolvers()
    register_sweeper()
    _app()


if __name__ == "__main__":
    main()
