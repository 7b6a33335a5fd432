"""What every console script shares: resolvers, the compose-time check, error lines and exit
codes (0 success, 2 a user error: one line naming the key, file or line; 1 an internal or
environment failure, one line (the traceback with verbose=true); 75 stopped by a signal)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from capibara_exp.base import environment
from capibara_exp.base.errors import ConfigError
from capibara_exp.cli import flags
from capibara_exp.composing.resolvers import register_resolvers

if TYPE_CHECKING:
    from capibara_exp.composing.config_check import Composition

USER_ERROR = 2
RUN_FAILED = 1


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
    # JAX's platforms before anything imports JAX: composing a merge's config loads the
    # merge methods (JAX), and JAX reads them once, at import (else libtpu's probe lines)
    environment.select_platform()
    with user_errors(prog, prefix="configuration error: "):
        line = flags.parse(argv)
        register_resolvers()
        if line.informing:
            if line.overrides and not line.completing:  # Hydra's app would refuse them as an
                # internal error, midway
                from capibara_exp.cli import compose as composing

                # kept, as --help keeps it: its text then composes nothing again
                composing.keep(composing.compose(config_name, [*line.overrides, *extra],
                                                 line.config_dirs, line.multirun, cached=True))
            environment.prepare()
            return line, None, line.hydra_argv(extra)
        from capibara_exp.cli import checks  # (gin and the bridge: not for --help)

        comp, overrides = checks.compose_checked(line, config_name, extra)
    environment.prepare(bool(comp.cfg.get("verbose")))
    return line, comp, [*overrides, *line.flags]  # (see CommandLine.hydra_argv)


def run_failed(prog: str, err: BaseException) -> None:
    """A run that could not go on (RunError): its one line (what was kept), exit 1."""
    print(f"{prog}: {err}", file=sys.stderr)
    sys.exit(RUN_FAILED)


@contextlib.contextmanager
def user_errors(prog: str, *types: type[BaseException], prefix: str = "") -> Iterator[None]:
    """Turn the given exception types (ConfigError and OmegaConf's errors, such as an
    interpolation of a key the command line deleted, always) into one line and exit 2; any
    other exception stays an internal failure."""
    from omegaconf.errors import OmegaConfBaseException

    from capibara_exp.cli import shell

    try:
        yield
    except (ConfigError, *types) as err:
        if shell.disk_failure(err):  # tensorstore's full disk, a ValueError: not the user's
            raise
        fail(prog, f"{prefix}{err}")
    except OmegaConfBaseException as err:  # a value the user's config cannot resolve
        fail(prog, f"{prefix}{err}")


def register_sweeper() -> None:
    """The capibara_optuna sweeper, also where Hydra's scan of hydra_plugins cannot see it
    (an editable install's import hook hides the directory from that scan)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.capibara_optuna_sweeper.capibara_optuna_sweeper import (
        CapibaraOptunaSweeper,
    )

    Plugins.instance().register(CapibaraOptunaSweeper)
