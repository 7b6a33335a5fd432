"""What a capibara-exp process sets up before JAX, TensorFlow or absl load, and its log levels.

Entry points call `prepare` first (the console scripts' `main`, `python -m
capibara_exp.runtime`); importing capibara_exp itself changes nothing. Quiet by default:
the libraries' notices on a CPU machine are turned off where they start (environment and
log levels read at import), and `verbose=True` leaves them all on.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

# Python loggers of the libraries underneath: absl (seqio's and orbax's messages), JAX's
# backend lookup ("Unable to initialize backend 'tpu'") and its compilation cache's set-up
# ("Resetting cache at ...", when a multi-process run turns the cache off: launch/peers.py
# says so in its own line).
QUIET_LOGGERS = ("absl", "jax._src.xla_bridge", "jax._src.compilation_cache")
# Native INFO lines TensorFlow's shared libraries print while they load (static
# initialisers, before any log level applies), with absl's preamble to them.
_LOAD_NOTICE = re.compile(r"^(I\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\] |WARNING: All log messages "
                          r"before absl::InitializeLog\(\) is called are written to STDERR)")


def prepare(verbose: bool = False) -> None:
    """Platform choice and native log levels, before any library reads them."""
    select_platform()
    # TensorFlow only reads data here (JAX owns the accelerators): no GPU probing (whose
    # failed cuInit is an error line on every CPU machine), and no oneDNN kernels (their
    # notice warns of float round-off; the input pipeline's ops move integers). Set whether
    # or not verbose, so that verbosity never changes what runs.
    os.environ.setdefault("TF_ENABLED_DEVICE_TYPES", "CPU")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ info and warnings
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def select_platform() -> None:
    """With libtpu installed (for ahead-of-time compiles) but no TPU attached, JAX would probe
    for one at start-up: about a second and libtpu's error lines on every run. Pick the
    platforms JAX starts with unless the user did; a TPU VM (TPU device files) is untouched,
    and so is a machine with a GPU plugin, where JAX's own choice stays."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME"):
        return
    if importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                 "jax_rocm60_plugin")):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


# The logger name of capibara-exp's own console lines copied into the run log
# (capibara-exp.log); a console handler that meets one drops it (printed already).
CONSOLE_COPY = "capibara_exp.console"


def set_log_levels(verbose: bool) -> None:
    """The run log (a file handler on the root logger: Hydra's job_logging writes
    capibara-exp.log in the run dir) takes every library's INFO records; the console shows
    them only when verbose, else only warnings, and the QUIET_LOGGERS' (seqio's advice on
    uncached tasks, orbax's file-by-file lines, JAX's backend lookup) only from ERROR up.
    Without a file handler (no run log) the quiet loggers stay at ERROR, as before."""
    root = logging.getLogger()
    has_file = any(isinstance(h, logging.FileHandler) for h in root.handlers)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(
            logging.INFO if verbose or has_file else logging.ERROR)
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler):
            continue
        for old in [f for f in handler.filters if isinstance(f, _ConsoleFilter)]:
            handler.removeFilter(old)
        handler.addFilter(_ConsoleFilter(verbose))


class _ConsoleFilter(logging.Filter):
    """What a console handler shows of the records the run log takes."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == CONSOLE_COPY:
            return False  # printed already
        if self.verbose:
            return True
        quiet = any(record.name == n or record.name.startswith(n + ".") for n in QUIET_LOGGERS)
        return record.levelno >= (logging.ERROR if quiet else logging.WARNING)


def copy_to_run_log(line: str) -> None:
    """A line capibara-exp printed, into the run log too: the root logger's file handlers
    only (where there are none, as in the commands whose Hydra log is stdout, nothing)."""
    record = logging.LogRecord(CONSOLE_COPY, logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


def import_tensorflow(verbose: bool = False) -> None:
    """Import TensorFlow (seqio's dependency) without the INFO lines its shared libraries
    print while loading, which no log level reaches; any other line passes through."""
    if verbose or "tensorflow" in sys.modules:
        import tensorflow  # noqa: F401

        return
    with _native_load_notices_dropped():
        import tensorflow  # noqa: F401


@contextlib.contextmanager
def _native_load_notices_dropped() -> Iterator[None]:
    """Route file descriptor 2 through a pipe while the block runs, passing on every line but
    the load notices (as they come, so nothing is lost if the process dies)."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def relay() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if not _LOAD_NOTICE.match(line.decode(errors="replace")):
                    os.write(saved, line)

    thread = threading.Thread(target=relay, name="capibara-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the relay reads to its end
        thread.join(timeout=5)
        os.close(saved)
