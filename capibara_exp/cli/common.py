"""What every console script shares: resolvers, the compose-time check, error lines and exit
codes (0 success, 2 a user error: one line naming the key, file or line; 1 an internal
failure, with its traceback)."""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
from collections.abc import Iterator

from omegaconf import OmegaConf

from capibara_exp import environment
from capibara_exp.cli import checks, flags
from capibara_exp.config_check import Composition
from capibara_exp.errors import ConfigError
from capibara_exp.paths import SWEEPS_ROOT

USER_ERROR = 2
RUN_FAILED = 1


def user_cache_dir(name: str) -> str:
    """<user cache dir>/capibara-exp/<name>: $XDG_CACHE_HOME, else ~/.cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(root), "capibara-exp", name)


def merge_methods() -> str:
    """The merge methods consensus registers (for capibara-exp-merge --help)."""
    from capibara_exp.consensus.merge import METHODS

    return ", ".join([*METHODS, "fedavg"])


def shipped_sweeps() -> str:
    """The search spaces in sweeps/ (the config group `sweeps`)."""
    return ", ".join(sorted(p.stem for p in (SWEEPS_ROOT / "sweeps").glob("*.yaml")))


def sweeper_keys() -> str:
    """The capibara_optuna sweeper's settings, from its YAML file."""
    import yaml

    from capibara_exp.paths import CONF_DIR

    data = yaml.safe_load((CONF_DIR / "hydra" / "sweeper" / "capibara_optuna.yaml").read_text())
    keys = [k for k in data if not k.startswith("_")]
    return textwrap.fill(", ".join(keys), 84, subsequent_indent="  ")


RESOLVERS = {
    "capibara_sweeps": shipped_sweeps,
    "capibara_sweeper_keys": sweeper_keys,
    "capibara_merge_methods": merge_methods,
    "abspath": lambda p: os.path.abspath(os.path.expanduser(p)),
    "capibara_sweeps_root": lambda: str(SWEEPS_ROOT),
    "capibara_cache_dir": user_cache_dir,
    # ${capibara_or:${a},b}: a unless it is null
    "capibara_or": lambda value, default: default if value is None else value,
}


def register_resolvers() -> None:
    """OmegaConf resolvers the shipped configs use."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def fail(prog: str, message: str) -> None:
    """A user error: one line on stderr, exit status 2."""
    one_line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"{prog}: {one_line}", file=sys.stderr)
    sys.exit(USER_ERROR)


def checked_argv(prog: str, config_name: str, argv: list[str],
                 extra: list[str] = ()) -> tuple[flags.CommandLine, Composition | None, list[str]]:
    """Parse and compose a command line as Hydra will, and check it, before Hydra runs it:
    a mistake is one line and exit 2 with nothing written. Sets up the process environment
    (environment.prepare) once `verbose` is known. Returns the command line, its composition
    (None for --help and the like, which Hydra answers alone) and the argv to give Hydra."""
    with user_errors(prog, prefix="configuration error: "):
        line = flags.parse(argv)
        register_resolvers()
        if line.informing:
            environment.prepare()
            return line, None, line.hydra_argv(extra)
        comp, overrides = checks.compose_checked(line, config_name, extra)
    environment.prepare(bool(comp.cfg.get("verbose")))
    return line, comp, [*line.flags, *overrides]


def run_failed(prog: str, err: BaseException) -> None:
    """A run that could not go on (RunError): its one line (what was kept), exit 1."""
    print(f"{prog}: {err}", file=sys.stderr)
    sys.exit(RUN_FAILED)


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
