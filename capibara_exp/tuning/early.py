"""Early-stop compiles: the planner's figures from XLA's dumps at buffer assignment.

XLA's TPU compile of a large step spends almost all its time in the backend's code
generation, after buffer assignment (Llama 3.1 8B at 8,192 tokens on v6e-256: the
optimized HLO and buffer assignment are dumped 2.3 s into a 184 s compile). The planner
reads the scheduled optimized HLO, which is settled by then, so this module compiles a
candidate in a child process with XLA's dump on (`--xla_dump_to`, text, only the step's
module), waits for the module after optimizations and its buffer assignment, and kills
the child. A child that ends on its own (XLA refused the step, e.g. out of HBM: raised at
buffer assignment, before any code generation; or the dumps never came) leaves the full
compile's own record instead.

What is read (docs/mesh_planning.md, "Early-stop compiles", has the measured limits):
- the HLO: the dump prints asynchronous ops in their generic form (`async-start(...),
  calls=%async_computation.N`) where `compiled.as_text()` prints the same op sugared
  (`slice-start(...), slice={...}`); `sugared()` rewrites them, so the profile and the
  estimate are those of the full compile;
- memory: the buffer assignment's HBM allocations (arguments, outputs, temporaries), not
  `memory_analysis()`'s peak, which the backend settles during code generation
  (`buffer_assignment_memory`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from capibara_exp.base.topologies import Chip
from capibara_exp.tuning import aot

MODULE_RE = "^jit__step$"  # the train step's module only (not its RNG seeding)
HLO_SUFFIX = ".after_optimizations.txt"
AFTER_BA_SUFFIX = ".after_optimizations_after_buffer_assignment.txt"
BA_SUFFIX = ".after_optimizations-buffer-assignment.txt"
POLL_S = 0.1

_ALLOC_RE = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_COLOR_RE = re.compile(r"\bcolor (\d+)\b")


def dump_flags(where: Path) -> str:
    return (f"--xla_dump_to={where} --xla_dump_hlo_as_text "
            f"--xla_dump_hlo_module_re={MODULE_RE}")


def dumped(where: Path) -> tuple[str, str] | None:
    """(optimized HLO text, buffer assignment text) once XLA has written both in full;
    None before. XLA writes the module twice at buffer assignment, the second copy last:
    the copies equal means both are complete."""
    for after in where.glob(f"*{AFTER_BA_SUFFIX}"):
        stem = after.name[: -len(AFTER_BA_SUFFIX)]
        hlo, ba = where / f"{stem}{HLO_SUFFIX}", where / f"{stem}{BA_SUFFIX}"
        if not (hlo.exists() and ba.exists() and ba.stat().st_size):
            continue
        text, again = hlo.read_text(), after.read_text()
        if text and text == again and text.rstrip().endswith("}"):
            return text, ba.read_text()
    return None


def buffer_assignment_memory(ba_text: str) -> dict[str, float]:
    """HBM bytes per chip of a buffer assignment dump: arguments, outputs (what may live
    out), their aliased part, and the total of HBM (color 0) allocations."""
    sizes = {"argument": 0.0, "output": 0.0, "alias": 0.0, "total": 0.0}
    for line in ba_text.splitlines():
        m = _ALLOC_RE.match(line)
        if not m:
            continue
        color = _COLOR_RE.search(m.group(2))
        if color and color.group(1) != "0":  # VMEM, SMEM...: on-chip, not HBM
            continue
        size, what = float(m.group(1)), m.group(2)
        sizes["total"] += size
        param, live_out = "parameter " in what, "maybe-live-out" in what
        sizes["argument"] += size if param else 0.0
        sizes["output"] += size if live_out else 0.0
        sizes["alias"] += size if param and live_out else 0.0
    return sizes


_COMP_RE = re.compile(r"^%?(async_computation[\w.\-]*) \(.*\{\s*$")
_ROOT_RE = re.compile(r"^\s*ROOT %?[\w.\-]+ = \S+ ([\w\-]+)\((.*)$")
_START_RE = re.compile(r"^(\s*(?:ROOT )?%?([\w.\-]+) = .*?) async-start\((.*?)\), "
                       r"calls=%?([\w.\-]+)(.*)$")
_DONE_RE = re.compile(r"^(\s*(?:ROOT )?%?[\w.\-]+ = .*?) async-done\(%?([\w.\-]+)\)(.*)$")


def _wrapped(lines: list[str]) -> dict[str, tuple[str, str]]:
    """async computation -> (its root's opcode, the root's attributes after its operands)."""
    out, current = {}, None
    for line in lines:
        header = _COMP_RE.match(line)
        if header:
            current = header.group(1)
            continue
        root = _ROOT_RE.match(line) if current else None
        if root:
            rest = root.group(2)
            attrs = rest[rest.index(")") + 1:] if ")" in rest else ""
            attrs = re.sub(r", (backend_config|metadata)=.*$", "", attrs)
            out[current] = (root.group(1), attrs)
            current = None
    return out


def sugared(text: str) -> str:
    """The dump's HLO with async ops printed as `compiled.as_text()` prints them:
    `op-start(...)` with the wrapped op's attributes, `op-done(...)`, and the wrapped
    computations (called by nothing else) left out."""
    lines = text.splitlines()
    wrapped = _wrapped(lines)
    started: dict[str, str] = {}
    out, skipping = [], False
    for line in lines:
        if _COMP_RE.match(line) and _COMP_RE.match(line).group(1) in wrapped:
            skipping = True
        if skipping:
            skipping = line.strip() != "}"
            continue
        start = _START_RE.match(line)
        if start and start.group(4) in wrapped:
            op, attrs = wrapped[start.group(4)]
            started[start.group(2)] = op
            line = f"{start.group(1)} {op}-start({start.group(3)}){attrs}{start.group(5)}"
        done = _DONE_RE.match(line)
        if done and done.group(2) in started:
            line = f"{done.group(1)} {started[done.group(2)]}-done(%{done.group(2)}){done.group(3)}"
        out.append(line)
    return "\n".join(out) + "\n"


def compile_step(cfg: Any, topology_name: str, chip: Chip, reserve_bytes: float = 0.0,
                 timeout_s: float = 3600.0) -> aot.Compiled:
    """aot.compile_step's record of cfg's step on a topology, from a compile stopped at
    buffer assignment (or, when the child ends first, its full compile's record)."""
    from omegaconf import OmegaConf

    where = Path(tempfile.mkdtemp(prefix="capibara-early-"))
    try:
        (where / "job.json").write_text(json.dumps({
            "cfg": OmegaConf.to_container(cfg, resolve=True), "topology": topology_name,
            "reserve_bytes": reserve_bytes}))
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " "
                                           + dump_flags(where / "dump")).strip()}
        t0 = time.perf_counter()
        with open(where / "child.log", "w") as log:
            child = subprocess.Popen([sys.executable, "-m", "capibara_exp.tuning.early",
                                      str(where)], env=env, stdout=log, stderr=log)
        try:
            found, cpu_s = _wait(child.pid, where, t0 + timeout_s)
        except BaseException:  # interrupted: the child's compile must not outlive us
            child.kill()
            child.wait()
            raise
        found_at = time.time()
        child.returncode = -1  # reaped by _wait: Popen must not wait for it again
        wall_s = time.perf_counter() - t0
        if found is None:
            return _child_result(where, wall_s, cpu_s)
        result = _from_dumps(where, *found, chip, reserve_bytes, wall_s, cpu_s)
        result.profiled["xla_until_dumps_s"] = found_at - result.profiled.pop("lowered_at")
        return result
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _wait(pid: int, where: Path, deadline: float) -> tuple[tuple[str, str] | None, float]:
    """(the dumps once complete, or None when the child ended first or the deadline
    passed; the child's CPU seconds, its threads included). The child is ended either way."""
    found = None
    while True:
        done, _, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return found, usage.ru_utime + usage.ru_stime
        if found is None and time.perf_counter() < deadline:
            found = (where / "lowered.json").exists() and dumped(where / "dump") or None
        if found is not None or time.perf_counter() >= deadline:
            os.kill(pid, signal.SIGKILL)
            _, _, usage = os.wait4(pid, 0)
            return found, usage.ru_utime + usage.ru_stime
        time.sleep(POLL_S)


def _from_dumps(where: Path, hlo_text: str, ba_text: str, chip: Chip, reserve_bytes: float,
                wall_s: float, cpu_s: float) -> aot.Compiled:
    meta = json.loads((where / "lowered.json").read_text())
    text = sugared(hlo_text)
    memory = buffer_assignment_memory(ba_text)
    fields = aot.profile_fields(text, meta["num_devices"], chip, meta["model_flops"],
                                meta["coords"])
    measured = {f"{k}_bytes": v for k, v in memory.items() if k != "total"}
    result = aot.Compiled(True, "", wall_s, cpu_s, memory["total"], meta["model_flops"], 0.0,
                          {**fields, **measured, "memory_source": "buffer_assignment",
                           "lowered_at": meta["lowered_at"],
                           "device_coords": meta["coords"]}, text, "early_stop")
    aot.check_budget(result, chip, reserve_bytes)
    return result


def _child_result(where: Path, wall_s: float, cpu_s: float) -> aot.Compiled:
    """The record the child wrote on ending by itself (a full compile, a refusal)."""
    path = where / "result.json"
    if not path.exists():
        lines = (where / "child.log").read_text(errors="replace").strip().splitlines()
        last = lines[-1] if lines else "no output"
        return aot.Compiled(False, f"compile failed: the early-stop child ended without a "
                            f"result: {aot.one_line(RuntimeError(last))}", wall_s, cpu_s)
    data = json.loads(path.read_text())
    data["record"].update(compile_s=wall_s, compile_cpu_s=cpu_s)
    fields = {f: data["record"].pop(f) for f in list(data["record"])
              if f not in aot.Compiled.__dataclass_fields__}
    return aot.Compiled(**data["record"], profiled=fields, hlo_text=data["hlo_text"])


def child_main(where: Path) -> None:
    """Lowers and compiles the job in `where`: lowered.json once lowered (so the parent
    knows the dumps it sees are this step's), result.json if the compile ends."""
    from omegaconf import OmegaConf

    from capibara_exp.base import environment, topologies
    from capibara_exp.base.errors import ConfigError
    from capibara_exp.tuning import tpu_slice as topology

    job = json.loads((where / "job.json").read_text())
    environment.import_tensorflow()
    target = topologies.get(job["topology"])
    devices = topology.devices(target)
    cfg = OmegaConf.create(job["cfg"])
    try:
        lowered, model_flops, coords = aot.lower_step(cfg, devices)
    except (ValueError, ConfigError) as err:
        result = aot.Compiled(False, f"invalid: {aot.one_line(err)}")
    else:
        (where / "lowered.json").write_text(json.dumps({
            "num_devices": len(devices), "model_flops": model_flops, "coords": coords,
            "lowered_at": time.time()}))
        result = aot.compile_lowered(lowered, len(devices), target.chip, model_flops, coords,
                                     job["reserve_bytes"])
    (where / "result.json").write_text(json.dumps({"record": result.record(),
                                                   "hlo_text": result.hlo_text}))


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
