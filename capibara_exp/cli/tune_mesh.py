"""Console script `capibara-exp-tune-mesh`: compose the experiment (as capibara-exp does) and
the search settings (conf/tune_mesh/default.yaml), then hand them to `plan.run`."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict

from capibara_exp import environment, phases
from capibara_exp.cli.common import checked_argv, fail, user_errors
from capibara_exp.cli.shell import console, job
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp-tune-mesh"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@job
def _app(cfg: DictConfig) -> dict:
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


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The experiment composes as for capibara-exp; the planner's settings join it as a group.
    if not any(arg.lstrip("+").startswith(f"{SETTINGS}=") for arg in argv):
        argv.append(f"+{SETTINGS}=default")
    line, comp, hydra_argv = checked_argv(PROG, "config", argv)
    runs = comp is not None and not line.shows_config  # a run, not --help or --cfg
    if runs:  # TensorFlow (seqio's) without its notices
        phases.starting(PROG)
        with phases.importing("TensorFlow"):
            environment.import_tensorflow(bool(comp.cfg.get("verbose")))
    if runs and comp.cfg.topology != "cpu":
        from capibara_exp.tuning import topology

        if not topology.libtpu_installed():  # before Hydra makes the study's dir
            fail(PROG, f"configuration error: topology={comp.cfg.topology}: "
                       f"{topology.INSTALL_HINT}")
    sys.argv = [sys.argv[0], *hydra_argv]
    _app()


if __name__ == "__main__":
    main()
