"""The error types every part of the project may raise (a leaf: it imports nothing).

The console scripts map them to exit codes (capibara_exp/cli/common.py): a ConfigError is
the user's to fix (exit 2, one line naming the key, file or line); any other exception is
an internal failure (exit 1, with its traceback).
"""


class ConfigError(ValueError):
    """A configuration or input mistake, reported with the key, file or line it comes from."""


class RunError(RuntimeError):
    """A correctly configured run that could not go on (diverged, preempted, out of memory);
    the message says what was kept (e.g. the last good checkpoint)."""
