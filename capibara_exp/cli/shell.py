"""The shell every console script's `main` runs in, from its first line to its last.

- SIGTERM and SIGINT are handled from process start: before training's own handler takes
  over (runtime/preemption.py), and again after it, a signal ends the process with status
  75 and one line saying what was kept (a compile, a restore, a data build, a merge leave
  nothing half-written that a later run would read).
- An OSError (disk full, read-only file system, a path that is a file, a name too long) is
  one line naming the path and the failure: exit 2 when the path is one the command line
  named, 1 otherwise (the environment's). So is tensorstore's report of one (a full disk,
  the file size limit, too many open files), and a file over RLIMIT_FSIZE (SIGXFSZ is
  ignored: EFBIG).
- The libraries' log records (orbax's writer threads, TensorFlow) reach no console
  handler once Hydra has set them up, and none after a failure: the run log has them.
- Any other exception is one line naming it (exit 1); verbose=true on the command line or
  CAPIBARA_VERBOSE=1 shows the traceback instead.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from capibara_exp.base.errors import ENVIRONMENT_ERRNOS, PREEMPTED_EXIT_CODE, ConfigError, Preempted
from capibara_exp.cli import light_exit

USER_ERROR = 2
RUN_FAILED = 1
# Failures a path can have that the user chose (exit 2 when the path is theirs).
PATH_ERRNOS = {errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.EEXIST, errno.ENOENT,
               errno.EROFS, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTEMPTY}
VERBOSE_ENV = "CAPIBARA_VERBOSE"
Kept = Callable[[list[str]], str]


def console(prog: str, kept: Kept | None = None) -> Callable:
    """Decorate a console script's `main(argv=None)`; `kept(argv)` says in words what a
    failure or a signal left (default: the inputs as they were)."""
    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> object:
            args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
            verbose = _verbose(args)
            # Hydra prints a job's exception with a traceback and exits 1; let it through,
            # without its own line before ours.
            os.environ.setdefault("HYDRA_FULL_ERROR", "1")
            hooks = (sys.excepthook, sys.unraisablehook, logging.raiseExceptions,
                     threading.excepthook)
            if not verbose:
                logging.getLogger("hydra.core.utils").addFilter(_quiet_job_error)
                _quiet_libraries()
            said = (lambda: kept(args)) if kept else (lambda: "the inputs are as they were")
            previous = _install(prog, said)
            _current[:] = [(prog, args, said, verbose)]
            # the console script's own call (argv from the command line), not a caller's
            entry = argv is None and _console_process()
            try:
                result = main(argv)
            except SystemExit as err:
                light_exit.end(err.code, entry)  # a config command: no teardown
                raise
            except GeneratorExit:
                raise
            except BaseException as err:  # noqa: BLE001 - the one place every failure ends
                _handle(err)
            else:
                light_exit.end(None, entry)
                return result
            finally:
                _restore(previous)
                if not _console_process():  # called in a process that goes on (tests)
                    sys.excepthook, sys.unraisablehook, logging.raiseExceptions, \
                        threading.excepthook = hooks
            return None
        return run
    return wrap


def _console_process() -> bool:
    first = sys.argv[0] if sys.argv else ""
    return os.path.basename(first).startswith("capibara-exp") or \
        first.replace(os.sep, "/").endswith("capibara_exp/cli/__main__.py")


_current: list[tuple] = []  # (prog, args, kept, verbose) of the console script running


def _handle(err: BaseException) -> None:
    """One line and the exit status for an exception that ends a console script."""
    prog, args, said, verbose = _current[0]
    if isinstance(err, KeyboardInterrupt):
        _stopped(prog, "SIGINT", said)
    if verbose:
        raise err
    if _console_process():  # what they log from here on is about this failure
        libraries_off_console()
    if isinstance(err, ConfigError):  # raised past the checks (a sweeper's settings)
        one_line = " ".join(str(err).split())
        print(f"{prog}: configuration error: {one_line}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR)
    if isinstance(err, OSError):
        _os_failure(prog, err, args, said)
    store = _tensorstore_os_error(err)
    if store is not None:  # tensorstore's (orbax's) report of an OS failure, as a ValueError
        _os_failure(prog, store, args, said)
    _internal(prog, err)


def _tensorstore_os_error(err: BaseException) -> OSError | None:
    """The OSError in tensorstore's report of a failed write (a full disk, the file size
    limit) or of an OS error that is the machine's (too many open files), or None."""
    text = str(err)
    full, code = _FULL_DISK.search(text), _OS_CODE.search(text)
    if full is None and not (code and int(code.group(1)) in ENVIRONMENT_ERRNOS):
        return None
    number = int(code.group(1)) if code else _STATUS_ERRNO[full.group(1)]
    path = full.group(2) if full else next(iter(_QUOTED_PATH.findall(text)), None)
    doing = " (writing a checkpoint)" if full else ""
    return OSError(number, f"{os.strerror(number)}{doing}", path)


def disk_failure(err: BaseException) -> bool:
    """Whether `err` is tensorstore's report of the machine's OS failure, whatever its type."""
    return not isinstance(err, ConfigError) and _tensorstore_os_error(err) is not None


# Both of tensorstore's forms: "... writing "<key>" in OCDBT database at local file "<path>""
# and "... writing local file "<path>"" (a checkpoint's metadata files); a full disk is
# RESOURCE_EXHAUSTED, a file over the size limit (RLIMIT_FSIZE) OUT_OF_RANGE
_FULL_DISK = re.compile(r"(RESOURCE_EXHAUSTED|OUT_OF_RANGE): Error writing (?:.*? at )?local "
                        r"file \"([^\"]+)\"")
_OS_CODE = re.compile(r"\[os_error_code='(\d+)'\]")
_STATUS_ERRNO = {"RESOURCE_EXHAUSTED": errno.ENOSPC, "OUT_OF_RANGE": errno.EFBIG}
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


def job(task: Callable) -> Callable:
    """Decorate a Hydra task function: its failure ends the process as `console` says, here
    (Hydra would print a line of its own first). A multirun's job raises on: the sweeper
    records it as failed and goes on."""
    @functools.wraps(task)
    def run(*a: object, **k: object) -> object:
        try:
            return task(*a, **k)
        except (SystemExit, GeneratorExit):
            raise
        except BaseException as err:  # noqa: BLE001
            if not _current or _multirun():
                raise
            _handle(err)
        return None

    @functools.wraps(task)
    def logged(*a: object, **k: object) -> object:
        if _current and not _current[0][3] and _console_process():  # Hydra has set up
            libraries_off_console()  # its log handlers by now (a test's are left alone)
        return run(*a, **k)
    return logged


# Loggers of the libraries underneath (and their children): absl carries orbax's and
# seqio's records, tensorflow has a console handler of its own.
# Python's warnings are records of py.warnings (JAX's "Error writing persistent compilation
# cache entry" when the disk fails the cache): no code of capibara-exp warns.
LIBRARIES = ("absl", "orbax", "jax", "jaxlib", "tensorflow", "tensorstore", "asyncio",
             "etils", "flax", "seqio", "t5x", "concurrent", "py.warnings")


class _LibrariesOff(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == n or record.name.startswith(n + ".") for n in LIBRARIES)


class _RunLogOnly(logging.Handler):
    """A library logger's records to the root logger's file handlers (the run log) alone,
    whichever handlers the root has by the time (Hydra's, a basicConfig's)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)


def libraries_off_console() -> None:
    """The libraries' log records reach no console handler: their loggers stop propagating
    to the root's (Hydra's console, one a library's `logging.warning` made) and hand them
    to the run log's file handlers instead; a library's own console handler (TensorFlow's)
    drops them. A disk that fills while orbax saves makes its writer threads log ERROR
    lines that would stand beside the one line saying so (verbose=true shows them). Again
    after Hydra configures logging, which replaces the handlers of the loggers it names."""
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _RunLogOnly) for h in logger.handlers):
            logger.addHandler(_RunLogOnly())
        logger.propagate = False
        for handler in logger.handlers:
            if (isinstance(handler, logging.StreamHandler)
                    and not isinstance(handler, logging.FileHandler)
                    and not any(isinstance(f, _LibrariesOff) for f in handler.filters)):
                handler.addFilter(_LibrariesOff())


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _quiet_job_error(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Error executing job")


class _OneLine(logging.Filter):
    """A library's log record without its traceback, on one line (verbose=true: whole)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text:
            record.exc_info, record.exc_text = None, None
            record.msg = " ".join(str(record.getMessage()).split())[:300]
            record.args = ()
        return True


def _quiet_libraries() -> None:
    """Libraries' background threads (orbax's savers, asyncio loops) print tracebacks of
    their own when a disk fills: their loggers' records go to the run log whole
    (`libraries_off_console`); a record on the root logger itself is kept to one line."""
    logging.getLogger().addFilter(_OneLine())
    threading.excepthook = _quiet_thread
    # tensorstore's callbacks print through sys.excepthook ("Event loop is closed" per
    # pending write); a log file on the full disk makes logging print its own traceback
    sys.excepthook = lambda kind, value, tb: _thread_errors.append(value)
    sys.unraisablehook = lambda unraisable: _thread_errors.append(unraisable.exc_value)
    logging.raiseExceptions = False
    if _console_process():  # Python's warnings become log records, kept off the console
        logging.captureWarnings(True)
        libraries_off_console()


def _quiet_thread(args: object) -> None:
    exc = getattr(args, "exc_value", None)
    if exc is not None and not isinstance(exc, SystemExit):
        _thread_errors.append(exc)


_thread_errors: list[BaseException] = []


def _ending() -> None:
    """After a console script's last line: what library threads and the interpreter's
    shutdown print is not for the user (a traceback per thread of a failed save)."""
    if _console_process():
        sys.stderr.flush()
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - until the process ends


def _verbose(args: list[str]) -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0") or any(
        a.replace(" ", "").lower() in ("verbose=true", "++verbose=true", "+verbose=true")
        for a in args)


def _install(prog: str, said: Callable[[], str]) -> dict:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the way out is quiet: no second one
            signal.signal(sig, signal.SIG_IGN)
        _stopped(prog, signal.Signals(signum).name, said)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    # A file over the size limit (RLIMIT_FSIZE) is then EFBIG, the one line of an OSError,
    # not a process killed by SIGXFSZ (CPython ignores it at start; an embedder may not)
    previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return previous


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _stopped(prog: str, name: str, said: Callable[[], str]) -> None:
    message = f"stopped by {name}: {_safe(said)}; run the same command again to go on"
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    _ending()
    raise Preempted(message)


def _safe(said: Callable[[], str]) -> str:
    try:
        return said()
    except Exception:  # noqa: BLE001 - the message must not fail in turn
        return "what was written before is kept"


def _original(err: OSError) -> OSError:
    """The OSError with its errno and path: gin re-raises a copy holding only the text
    ("[Errno 28] No space left on device ... In call to configurable 'train'")."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    found = re.match(r"\[Errno (\d+)\] ([^:\n]+)(?:: '([^'\n]+)')?", str(err))
    if found:
        return OSError(int(found.group(1)), found.group(2).strip(), found.group(3))
    return err


def _written_file(err: BaseException) -> str | None:
    """The file a write without a name in its OSError was writing (a full disk or the file
    size limit fails `write` or `close`, whose error holds no path): the open file in the
    innermost frame of the traceback that holds one."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


def _os_failure(prog: str, err: OSError, args: list[str], said: Callable[[], str]) -> None:
    err = _original(err)
    if err.filename is None and err.errno is not None:
        err = OSError(err.errno, err.strerror or str(err), _written_file(err))
    name = errno.errorcode.get(err.errno or 0, "")
    where = " ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    reason = err.strerror or (str(err).splitlines() or [type(err).__name__])[0]
    reason += (" (writing a checkpoint)" if ".orbax-checkpoint-tmp" in where  # (orbax's own
               and "checkpoint)" not in reason else "")  # writes, besides tensorstore's)
    mine = err.errno in PATH_ERRNOS and any(_named(f, args) for f in (err.filename,
                                                                      err.filename2) if f)
    text = f"{where}: {reason}" if where else reason
    print(f"{prog}: {text}{f' ({name})' if name else ''}{_limit(err.errno)}; {_safe(said)}",
          file=sys.stderr, flush=True)
    _ending()
    sys.exit(USER_ERROR if mine else RUN_FAILED)


def _limit(number: int | None) -> str:
    """The process's own limit behind a failure, where one is set: the user can raise it."""
    import resource

    which = {errno.EMFILE: (resource.RLIMIT_NOFILE, "open files", "ulimit -n"),
             errno.EFBIG: (resource.RLIMIT_FSIZE, "bytes a file", "ulimit -f")}.get(number)
    if which is None:
        return ""
    soft = resource.getrlimit(which[0])[0]
    return "" if soft == resource.RLIM_INFINITY else \
        f" (this process may have {soft} {which[1]}: {which[2]})"


def _named(filename: object, args: list[str]) -> bool:
    """Whether a failing path is (or lies under) a path the command line named."""
    try:
        failing = Path(os.path.abspath(os.fsdecode(filename)))
    except (TypeError, ValueError):
        return False
    for arg in args:
        for value in _path_values(arg):
            try:
                named = Path(os.path.abspath(value))
            except (TypeError, ValueError):
                continue
            if failing == named or named in failing.parents:
                return True
    return False


def _path_values(arg: str) -> list[str]:
    value = arg.split("=", 1)[1] if "=" in arg else arg
    return [v.strip(" '\"") for v in value.strip("[]").split(",") if v.strip(" '\"")]


def _internal(prog: str, err: BaseException) -> None:
    text = " ".join(str(err).split())[:300] or "(no message)"
    print(f"{prog}: internal error: {type(err).__name__}: {text} (verbose=true or "
          f"{VERBOSE_ENV}=1 shows the traceback)", file=sys.stderr, flush=True)
    _ending()
    sys.exit(RUN_FAILED)


__all__ = ["console", "PREEMPTED_EXIT_CODE"]
