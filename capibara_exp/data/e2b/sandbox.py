"""A local code sandbox: cells run in a subprocess with time and memory limits, no network.

Each call starts one runner process (capibara_exp/data/runners/) in a fresh temporary
working dir with a minimal environment. Limits: a per-cell wall-clock timeout (inside the
runner), a CPU-seconds and address-space rlimit and a file-size rlimit for the process,
and a wall-clock limit for the whole batch (outside it). The network is cut with a new
network namespace (`unshare -rn`) where the kernel allows one, for the runner and every
process it starts. Otherwise it is cut inside the runner only: the Python and SQL runners
get a socket module that refuses to connect or resolve, node gets a preload
(runners/no_network.js) that makes net, dgram, dns and fetch refuse; the records' sandbox
metadata says which (`network`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from capibara_exp.data.e2b.records import utf8_text

RUNNERS = Path(__file__).parent / "runners"
_RUNNER_FILES = {"python": "python_cells.py", "sql": "sql_cells.py", "javascript": "js_cells.js"}
NO_SOCKETS = (
    "import socket\n"
    "def _refuse(*a, **k):\n    raise OSError('network access is disabled in this sandbox')\n"
    "for _name in ('connect', 'connect_ex', 'sendto', 'sendmsg'):\n"
    "    setattr(socket.socket, _name, _refuse)\n"
    "for _name in ('create_connection', 'getaddrinfo', 'gethostbyname', 'gethostbyname_ex',\n"
    "              'gethostbyaddr'):\n"
    "    setattr(socket, _name, _refuse)\n"
)
# Network isolation of the records (sandbox metadata `network`).
NAMESPACE = "namespace"  # a network namespace with no interfaces: the whole process tree
IN_PROCESS = "in-process-blocked"  # the runner's own socket/net/dns/fetch APIs refuse


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one runner process."""

    cell_timeout_s: float = 2.0
    memory_mb: int = 2048
    max_file_mb: int = 16


@functools.cache
def network_isolation() -> str:
    """NAMESPACE when `unshare -rn` works here, else IN_PROCESS."""
    unshare = shutil.which("unshare")
    if unshare:
        done = subprocess.run([unshare, "-rn", "true"], capture_output=True, check=False)
        if done.returncode == 0:
            return NAMESPACE
    return IN_PROCESS


def node_binary() -> str | None:
    return shutil.which("node")


def _command(language: str, workdir: Path) -> list[str]:
    runner = str(RUNNERS / _RUNNER_FILES[language])
    if language == "javascript":
        node = node_binary()
        if node is None:
            raise FileNotFoundError("node is not installed: JavaScript cells cannot run")
        # vm modules: README examples with import/export run as ES modules.
        cmd = [node, "--max-old-space-size=256", "--experimental-vm-modules", "--no-warnings"]
        if network_isolation() != NAMESPACE:
            cmd += ["--require", str(RUNNERS / "no_network.js")]
        cmd.append(runner)
    else:
        cmd = [sys.executable, "-s", runner]
        if network_isolation() != NAMESPACE:
            (workdir / "sitecustomize.py").write_text(NO_SOCKETS)
    return (["unshare", "-rn"] if network_isolation() == NAMESPACE else []) + cmd


def _limit(limits: Limits, cpu_s: int, language: str):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        size = limits.max_file_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        if language != "javascript":  # V8 reserves far more address space than it uses
            mem = limits.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    return apply


def program_env(workdir: Path) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(workdir),
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": str(workdir),
        "TZ": "UTC",
    }
    node_path = [
        p
        for p in ("/usr/lib/node_modules", "/usr/lib/node_modules/npm/node_modules")
        if Path(p).is_dir()
    ]
    if node_path:
        env["NODE_PATH"] = ":".join(node_path)
    return env


def _run_runner(language: str, request: dict, limits: Limits, batch_s: float):
    """Run one runner process on a request: (stdout lines as dicts, stderr tail, cause)."""
    with tempfile.TemporaryDirectory(prefix="capibara-sandbox-") as tmp:
        workdir = Path(tmp)
        proc = subprocess.Popen(
            _command(language, workdir),
            cwd=workdir,
            env=program_env(workdir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_limit(limits, int(batch_s) + 1, language),
        )
        try:
            stdout, stderr = proc.communicate(json.dumps(request).encode(), timeout=batch_s)
            cause = f"the sandbox process exited with status {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            cause = f"the sandbox batch exceeded {batch_s:.0f} s"
    lines = []
    for line in stdout.decode("utf-8", errors="replace").splitlines():
        try:
            out = json.loads(line)
        except json.JSONDecodeError:
            continue  # a cell that wrote to the protocol stream itself
        if isinstance(out, dict) and "id" in out:
            lines.append(utf8_text(out))
    return lines, stderr.decode("utf-8", errors="replace")[-2000:], cause


def run_cells(language: str, cells: list[dict], limits: Limits = Limits()) -> list[dict]:
    """Run cells ({"id", "code", "reset"}) in one sandbox; one output dict per cell, in order.

    A cell whose output never came back (the process was killed for time or memory, or
    crashed) gets an error named after the cause, so every cell has a record.
    """
    batch_s = limits.cell_timeout_s * len(cells) + 20
    request = {"cells": cells, "timeout_s": limits.cell_timeout_s}
    lines, tail, cause = _run_runner(language, request, limits, batch_s)
    outputs = {out["id"]: out for out in lines}
    return [outputs.get(c["id"]) or _lost(c["id"], cause, tail) for c in cells]


def javascript_syntax_errors(codes: dict[str, str], limits: Limits = Limits()) -> dict[str, str]:
    """{id: 'SyntaxError: ...'} for each code that node cannot compile as its cell would run
    (ES module or script); nothing is executed. Raises if node gives no answer."""
    cells = [{"id": k, "code": v} for k, v in codes.items()]
    request = {"cells": cells, "timeout_s": limits.cell_timeout_s, "check_only": True}
    lines, tail, cause = _run_runner("javascript", request, limits, 60 + 0.05 * len(cells))
    checked = {out["id"]: out.get("syntax_error") for out in lines}
    if set(checked) != set(codes):
        raise RuntimeError(f"node's syntax check of {len(codes)} cells failed: {cause}\n{tail}")
    return {k: f"{e['name']}: {e['value']}" for k, e in checked.items() if e}


def _lost(cell_id: str, cause: str, stderr_tail: str) -> dict:
    return {
        "id": cell_id,
        "results": [],
        "stdout": [],
        "stderr": [],
        "error": {"name": "SandboxError", "value": cause, "traceback": stderr_tail},
        "execution_count": None,
        "duration_ms": 0.0,
        "started_at": "",
    }


def sandbox_metadata(language: str) -> dict:
    """What the records say about where they ran."""
    return {
        "engine": "local-subprocess",
        "template": f"local-{language}",
        "sandbox_id": f"local-{uuid.uuid4().hex[:12]}",
        "network": network_isolation(),
        "python": sys.version.split()[0],
    }
