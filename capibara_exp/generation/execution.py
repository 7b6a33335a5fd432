"""Generated programs run to be scored: each in its own process, fresh working dir, limits.

Built on the E2B sandbox's parts (capibara_exp/data/e2b/sandbox.py: its Limits, its minimal
environment, its network cut). One program is one process tree, so a hostile one harms no
other: a new session and, where the kernel allows, new user, network, PID and mount
namespaces (`unshare -rn --pid --fork --kill-child --mount-proc`), so it sees no network
and, inside its PID namespace, can signal nothing outside (its parent included); run as
`nobody` when started by root (root is exempt from the process-count limit, and nobody
owns no files to overwrite); rlimits on CPU seconds, address space, file size, processes
and core files; a wall-clock limit after which the whole tree is killed; stdout and stderr
into files (capped by the file-size limit; only their first MAX_TEXT bytes are read); and
an audit hook that refuses to open files for writing outside the working dir. Whatever
a program does, the result is an outcome, never an exception in the caller.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from capibara_exp.data.e2b import sandbox

# subprocess forks to run preexec_fn; what runs in the child before exec (setsid, setrlimit,
# setuid) takes no lock a JAX thread could hold, so its warning about forking is noise here.
warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)

Limits = sandbox.Limits
MAX_TEXT = 1 << 16  # bytes of stdout/stderr kept per program
MAX_PROCESSES = 32
NOBODY = 65534
# Loaded before the program (sitecustomize): no file opened for writing outside the working
# dir, and no sockets where no network namespace cuts them.
_GUARD = """
import os, sys
_HOME = os.path.realpath(os.getcwd())
def _guard(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        mode, flags = args[1] or "r", args[2] or 0
        writing = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR)
        path = os.path.realpath(os.fsdecode(args[0]))
        if writing and path != _HOME and not path.startswith(_HOME + os.sep):
            raise PermissionError(f"writing outside the working dir is refused: {path}")
sys.addaudithook(_guard)
del _guard
"""


@dataclasses.dataclass
class Outcome:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the time limit
    error: str | None  # why it failed: exception line, signal, time limit; None when fine

    @property
    def ok(self) -> bool:
        return self.error is None


def interpreter() -> str:
    """The base Python (programs get the standard library only); run as nobody, the first
    that nobody may execute (a venv's or one under /root may be closed to it)."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if os.geteuid() != 0:
        return base
    for candidate in (base, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and _open_to_others(Path(candidate)):
            return candidate
    raise RuntimeError("no Python interpreter that user nobody may run (programs are run "
                       "as nobody when the scorer runs as root)")


def _open_to_others(path: Path) -> bool:
    """Every directory above the file searchable, and the file executable, by anyone."""
    real = path.resolve()
    dirs_ok = all(p.stat().st_mode & 0o001 for p in real.parents)
    return dirs_ok and bool(real.stat().st_mode & 0o001)


def _namespaces() -> list[str]:
    if sandbox.network_isolation() != sandbox.NAMESPACE:
        return []
    return ["unshare", "-rn", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _preexec(limits: Limits, cpu_s: int, drop_to_nobody: bool):
    def apply() -> None:
        os.setsid()
        for rlimit, value in ((resource.RLIMIT_CPU, cpu_s),
                              (resource.RLIMIT_FSIZE, limits.max_file_mb << 20),
                              (resource.RLIMIT_AS, limits.memory_mb << 20),
                              (resource.RLIMIT_NPROC, MAX_PROCESSES),
                              (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(rlimit, (value, value))
        if drop_to_nobody:
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    return apply


def _workdir() -> tuple[Path, Path]:
    """(the program's fresh working dir, a dir of ours for its output files)."""
    root = Path(tempfile.mkdtemp(prefix="capibara-exec-"))
    work, logs = root / "work", root / "logs"
    work.mkdir()
    logs.mkdir()
    if os.geteuid() == 0:
        os.chown(work, NOBODY, NOBODY)
        os.chown(logs, NOBODY, NOBODY)
    root.chmod(0o755)
    return work, logs


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_TEXT).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(code: str, limits: Limits | None = None, python: str | None = None) -> Outcome:
    """Run a Python program under the limits; its outcome (never raises for the program)."""
    limits = limits or Limits()
    work, logs = _workdir()
    try:
        (work / "main.py").write_text(code, encoding="utf-8")
        (work / "sitecustomize.py").write_text(
            _GUARD + ("" if _namespaces() else sandbox.NO_SOCKETS), encoding="utf-8")
        env = {**sandbox.program_env(work), "PYTHONPATH": str(work)}
        with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
            proc = subprocess.Popen(
                [*_namespaces(), python or interpreter(), "-s", "main.py"], cwd=work,
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True,
                preexec_fn=_preexec(limits, int(limits.cell_timeout_s) + 1, os.geteuid() == 0))
            try:
                code_ = proc.wait(timeout=limits.cell_timeout_s + 1.0)
            except subprocess.TimeoutExpired:
                code_ = None
            _kill_tree(proc)  # what it left running, too
            proc.wait()
        stdout, stderr = _read(logs / "out"), _read(logs / "err")
        return Outcome(stdout, stderr, code_, _error(code_, stderr, limits))
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)


def _error(returncode: int | None, stderr: str, limits: Limits) -> str | None:
    if returncode is None:
        return f"TimeoutError: over {limits.cell_timeout_s:g} s"
    if returncode == 0:
        return None
    if returncode < 0 or returncode > 128:
        number = -returncode if returncode < 0 else returncode - 128
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"exit status {returncode}"
    last = [line for line in stderr.strip().splitlines() if line.strip()]
    return last[-1] if last else f"exit status {returncode}"
