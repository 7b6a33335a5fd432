"""What every console script shares: resolvers, the YAML pre-check, error lines and exit
codes (0 success, 2 a user error: one line naming the key, file or line; 1 an internal
failure, with its traceback)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from omegaconf import OmegaConf

from capibara_exp.errors import ConfigError
from capibara_exp.paths import CONF_DIR, SWEEPS_ROOT

USER_ERROR = 2


def register_resolvers() -> None:
    """OmegaConf resolvers the shipped configs use."""
    if not OmegaConf.has_resolver("abspath"):
        OmegaConf.register_new_resolver("abspath", lambda p: os.path.abspath(os.path.expanduser(p)))
    if not OmegaConf.has_resolver("capibara_sweeps_root"):
        OmegaConf.register_new_resolver("capibara_sweeps_root", lambda: str(SWEEPS_ROOT))


def config_dirs(argv: list[str]) -> list[Path]:
    """conf/ and the directories `--config-dir` adds."""
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


def exit_on_bad_yaml(prog: str, dirs: list[Path]) -> None:
    problem = check_yaml(dirs)
    if problem:
        fail(prog, f"configuration error: {problem}")


def fail(prog: str, message: str) -> None:
    """A user error: one line on stderr, exit status 2."""
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(USER_ERROR)


@contextlib.contextmanager
def user_errors(prog: str, *types: type[BaseException], prefix: str = "") -> Iterator[None]:
    """Turn the given exception types (ConfigError always) into one line and exit 2; any
    other exception stays an internal failure."""
    try:
        yield
    except (ConfigError, *types) as err:
        fail(prog, f"{prefix}{err}")


def register_sweeper() -> None:
    """The capibara_optuna sweeper, also where Hydra's scan of hydra_plugins cannot see it
    (an editable install's import hook hides the directory from that scan)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.capibara_optuna_sweeper.capibara_optuna_sweeper import (
        CapibaraOptunaSweeper,
    )

    Plugins.instance().register(CapibaraOptunaSweeper)
