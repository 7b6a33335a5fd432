"""Console script `capibara-exp-tune-mesh`: compose the experiment (as capibara-exp does) and
the search settings (conf/tune_mesh/default.yaml), then hand them to `plan.run`."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from capibara_exp.cli import check_yaml, register_resolvers
from capibara_exp.gin_bridge import ConfigError
from capibara_exp.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _app(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig

    from capibara_exp.tuning import plan

    hc = HydraConfig.get()
    try:
        return plan.run(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))
    except (ConfigError, RuntimeError) as err:
        print(f"capibara-exp-tune-mesh: {err}", file=sys.stderr)
        sys.exit(2)


SETTINGS = "tune_mesh"


def main() -> None:
    # The experiment composes as for capibara-exp; the planner's settings join it as a group.
    if not any(arg.lstrip("+").startswith(f"{SETTINGS}=") for arg in sys.argv[1:]):
        sys.argv.append(f"+{SETTINGS}=default")
    problem = check_yaml([CONF_DIR])
    if problem:
        print(f"capibara-exp-tune-mesh: configuration error: {problem}", file=sys.stderr)
        sys.exit(2)
    register_resolvers()
    _app()


if __name__ == "__main__":
    main()
