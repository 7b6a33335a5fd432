"""Console script `capibara-exp-tune-mesh`: compose the experiment (as capibara-exp does) and
the search settings (conf/tune_mesh/default.yaml), then hand them to `plan.run`."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from capibara_exp.cli.common import exit_on_bad_yaml, register_resolvers, user_errors
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp-tune-mesh"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _app(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig

    from capibara_exp.tuning import plan

    hc = HydraConfig.get()
    with user_errors(PROG, RuntimeError):
        return plan.run(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))


SETTINGS = "tune_mesh"


def main() -> None:
    # The experiment composes as for capibara-exp; the planner's settings join it as a group.
    if not any(arg.lstrip("+").startswith(f"{SETTINGS}=") for arg in sys.argv[1:]):
        sys.argv.append(f"+{SETTINGS}=default")
    exit_on_bad_yaml(PROG, [CONF_DIR])
    register_resolvers()
    _app()


if __name__ == "__main__":
    main()
