"""The shell of the console scripts that run one Hydra job (capibara-exp-data, -merge,
-tune-mesh): the command line composed and checked before Hydra sees it (one line, exit 2,
nothing written), the script's own checks, the `starting` line and the heavy imports, then
Hydra's app. A script keeps its job, its checks and its `_app`; tests replace `_app` to
stop a command at the door of its job."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import hydra
from omegaconf import DictConfig

from capibara_exp.base import environment, phases
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli.common import checked_argv, user_errors
from capibara_exp.cli.shell import job

Check = Callable[[DictConfig], None]


def hydra_app(config_name: str, task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """Hydra's app for conf/<config_name>.yaml with `task` as its job."""
    return hydra.main(config_path=str(CONF_DIR), config_name=config_name,
                      version_base="1.3")(job(task))


def run(prog: str, config_name: str, argv: list[str], app: Callable[[], Any], *,
        check: Check | None = None, tensorflow: bool = False, started: Check | None = None,
        around: Callable[[DictConfig], AbstractContextManager] | None = None) -> None:
    """Compose and check `argv`; for a job (not --help, --cfg, ...): `check` (before
    anything is printed or made), the starting line, TensorFlow when the job needs it,
    `started` (checks that need what was imported), then `app()` inside `around`."""
    line, comp, hydra_argv = checked_argv(prog, config_name, argv)
    runs = comp is not None and not line.shows_config
    if runs:
        _checked(prog, check, comp.cfg)
        phases.starting(prog)  # before the heavy imports
        if tensorflow:  # TensorFlow (seqio's) without its notices
            with phases.importing("TensorFlow"):
                environment.import_tensorflow(bool(comp.cfg.get("verbose")))
        _checked(prog, started, comp.cfg)
    sys.argv = [sys.argv[0], *hydra_argv]
    with around(comp.cfg) if runs and around else contextlib.nullcontext():
        app()


def _checked(prog: str, check: Check | None, cfg: DictConfig) -> None:
    if check is not None:
        with user_errors(prog, prefix="configuration error: "):
            check(cfg)
