"""Console script `capibara-exp-tune-mesh`: compose the experiment (as capibara-exp does) and
the search settings (conf/tune_mesh/default.yaml), then hand them to `plan.run`."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, open_dict

from capibara_exp.base.errors import ConfigError
from capibara_exp.cli import app
from capibara_exp.cli.common import user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-tune-mesh"


def _plan(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig

    from capibara_exp.tuning import plan

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).absolute()
    if cfg.get("model_dir") is None:  # config.gin's MODEL_DIR for the candidates' gin
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.model_dir = str(run_dir)
    with user_errors(PROG):
        return plan.run(cfg, run_dir, list(hc.overrides.task))


SETTINGS = "tune_mesh"
_app = app.hydra_app("config", _plan)


def check_libtpu(cfg: DictConfig) -> None:
    """A TPU topology needs libtpu: refused before Hydra makes the study's dir."""
    if cfg.topology != "cpu":
        from capibara_exp.tuning import tpu_slice

        if not tpu_slice.libtpu_installed():
            raise ConfigError(f"topology={cfg.topology}: {tpu_slice.INSTALL_HINT}")


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The experiment composes as for capibara-exp; the planner's settings join it as a group.
    if not any(arg.lstrip("+").startswith(f"{SETTINGS}=") for arg in argv):
        argv.append(f"+{SETTINGS}=default")
    app.run(PROG, "config", argv, lambda: _app(), tensorflow=True, started=check_libtpu)


if __name__ == "__main__":
    main()
