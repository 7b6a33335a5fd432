"""The error types every part of the project may raise (a leaf: it imports nothing).

The console scripts map them to exit codes (capibara_exp/cli/common.py): a ConfigError is
the user's to fix (exit 2, one line naming the key, file or line); any other exception is
an internal failure (exit 1, with its traceback). A preempted run exits with
PREEMPTED_EXIT_CODE (75) after saving a checkpoint of its last finished step.
"""


class ConfigError(ValueError):
    """A configuration or input mistake, reported with the key, file or line it comes from."""


class NotBuilt(ConfigError):
    """The data a task reads are not built under the data dir: one line naming the command
    that builds them (data/e2b/built.py: read_manifest). Here, not beside its reader, so
    that the runtime and T5X's launcher can tell it from other errors without reaching
    into the offline data pipeline."""


class RunError(RuntimeError):
    """A correctly configured run that could not go on (diverged, preempted, out of memory);
    the message says what was kept (e.g. the last good checkpoint)."""


class TrainingDiverged(RunError):
    """The loss or gradient became NaN/Inf (too often, under the skip policy), or a state to
    be saved held NaN/Inf; nothing non-finite was written, and the message names the newest
    finite checkpoint (or says there is none)."""


# sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry"): a preempted
# run saved the last finished step and resumes from it when started again.
PREEMPTED_EXIT_CODE = 75


class Preempted(SystemExit):
    """SIGTERM/SIGINT (or a preemption notice on any host) stopped training after a step and
    a checkpoint of that step was saved. A SystemExit: the process ends with
    PREEMPTED_EXIT_CODE, past Hydra's and the console scripts' error handling."""

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


# What the machine lacks, not what a file holds: too many open files (the process's or the
# system's), memory, a full disk, a file over the size limit.
ENVIRONMENT_ERRNOS = frozenset({24, 23, 12, 28, 27})  # EMFILE ENFILE ENOMEM ENOSPC EFBIG


def environment_failure(err: BaseException) -> bool:
    """Whether reading or writing failed for want of descriptors, memory or space (an
    OSError, or tensorstore's error naming the OS error): a checkpoint read that fails so
    is not damaged, and must not be set aside as if it were."""
    seen: BaseException | None = err
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:  # a chain may loop back
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in ENVIRONMENT_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    return any(f"os_error_code='{n}'" in text or f"[Errno {n}]" in text
               for n in ENVIRONMENT_ERRNOS) or "Too many open files" in text
