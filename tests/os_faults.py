"""OS faults for the console scripts: each real script run in its own process under a
resource limit (RLIMIT_FSIZE: a file over N bytes fails with EFBIG, the full disk's
stand-in; RLIMIT_NOFILE: few descriptors, EMFILE), or on a tiny tmpfs (a real full disk,
ENOSPC; mounting one needs root).

The property, for every script and fault: the exit status is 0, 1, 2 or 75; the console
holds the script's own lines only (no traceback, no library's log line) and a failure is
its last line, the only one that reports a failure; the inputs (the run, its checkpoints,
the data dir, the prompts) are as they were, hashes and mtimes; and a run's newest
checkpoint from before the fault is intact, with no half-written one left under a
checkpoint's name.

    python -m tests.os_faults --out /tmp/faults     # every script under every limit
"""

from __future__ import annotations

import argparse
import contextlib
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.snapshots import snapshot

TINY = ["debug=fast", "model.emb_dim=32", "model.mlp_dim=64", "data.batch_size=4"]
MODULE = {"capibara-exp": "capibara_exp.cli.main", "capibara-exp-data": "capibara_exp.cli.data",
          "capibara-exp-merge": "capibara_exp.cli.merge",
          "capibara-exp-plot": "capibara_exp.cli.plot",
          "capibara-exp-generate": "capibara_exp.cli.generate"}
# (name, resource, soft limit): small enough that the scripts' own writes hit them
LIMITS = {
    "fsize=512": (resource.RLIMIT_FSIZE, 512),  # a generation's output file (2 prompts)
    "fsize=4k": (resource.RLIMIT_FSIZE, 4 << 10),
    "fsize=100k": (resource.RLIMIT_FSIZE, 100 << 10),
    "fsize=1m": (resource.RLIMIT_FSIZE, 1 << 20),
    "nofile=12": (resource.RLIMIT_NOFILE, 12),
    "nofile=24": (resource.RLIMIT_NOFILE, 24),
}
SAFE = {0, 1, 2, 75}


def limited(rlimits: list[tuple[int, int]]) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec: the soft limit only (tests can undo)
        for which, soft in rlimits:
            hard = resource.getrlimit(which)[1]
            resource.setrlimit(which, (soft, hard))
    return apply


def call(script: str, args: list[str], cwd: Path, rlimits: list[tuple[int, int]] = (),
         env: dict | None = None) -> subprocess.CompletedProcess:
    program = (f"import sys; sys.argv[0] = {script!r}\n"
               f"from {MODULE[script]} import main\nmain()\n")
    return subprocess.run([sys.executable, "-c", program, *args], cwd=cwd, text=True,
                          capture_output=True, timeout=900, env=env,
                          preexec_fn=limited(list(rlimits)) if rlimits else None)


def commands(run: Path, data_dir: Path, prompts: Path, work: Path) -> dict[str, list[str]]:
    """Each script's command on the inputs (outputs new, under `work`)."""
    return {
        "capibara-exp": [*TINY, f"data_dir={data_dir}", f"model_dir={work / 'resumed'}",
                         "trainer.train_steps=8"],
        "capibara-exp-data": [f"data_dir={work / 'data'}", "collect.sources=[sqlite_statements]",
                              "collect.max_per_source=30"],
        "capibara-exp-merge": [f"runs=[{run}]", f"out={work / 'merged'}"],
        "capibara-exp-plot": [str(run), "--out", str(work / "curves.png")],
        "capibara-exp-generate": [f"checkpoint={run}", f"prompts={prompts}",
                                  f"out={work / 'out.jsonl'}", "max_new_tokens=4"],
    }


_FAILURE = re.compile(r"error|Error|ERROR|failed|\(E[A-Z]+\)|stopped by|Traceback")


def problems(script: str, out: subprocess.CompletedProcess) -> list[str]:
    """What breaks the property in a finished script's exit status and console."""
    found = []
    if out.returncode not in SAFE:
        found.append(f"exit status {out.returncode}")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    foreign = [line for line in lines if not (line.startswith(f"{script}:")
                                              or line.startswith("step ")
                                              or line.startswith("e2b_routing: "))]
    if foreign:
        found.append(f"{len(foreign)} line(s) not the script's own, first: {foreign[0][:200]}")
    # a path may hold any word (pytest's tmp dirs are named after the test)
    failing = [line for line in lines if _FAILURE.search(re.sub(r"\S*/\S*", "", line))]
    if out.returncode != 0:
        if not lines or len(failing) != 1 or failing[0] != lines[-1]:
            found.append(f"exit {out.returncode} and {len(failing)} failure line(s), "
                         "not the last one alone")
    elif failing:
        found.append(f"exit 0 with a failure line: {failing[0][:200]}")
    return found


def checkpoints_kept(model_dir: Path, kept: dict) -> list[str]:
    """The newest checkpoint from before the fault is as it was; every dir under a
    checkpoint's name verifies (a half-written save keeps orbax's tmp name)."""
    from capibara_exp.runtime import integrity

    found = []
    if snapshot(model_dir / "checkpoint_4") != kept:
        found.append("checkpoint_4 changed")
    for step_dir in model_dir.glob("checkpoint_*"):
        if step_dir.name[len("checkpoint_"):].isdigit():
            bad = integrity.verify_checkpoint(step_dir)
            if bad:
                found.append(f"{step_dir.name} does not verify: {bad[:2]}")
    return found


@contextlib.contextmanager
def tiny_disk(where: Path, size: str) -> Iterator[str]:
    """A tmpfs of `size` mounted at `where` (made): a disk that really fills (ENOSPC).
    Yields "" when mounted, else why not (mounting needs root or CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    try:
        yield "" if mounted.returncode == 0 else (mounted.stderr.strip() or "mount failed")
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(where)], check=False)


def one_case(script: str, rlimits: list[tuple[int, int]], run: Path, data_dir: Path,
             prompts: Path, work: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run one script under `rlimits` in `work` (new or empty: a tiny disk may be mounted
    there); (its result, the problems)."""
    inputs = {p: snapshot(p) for p in (run, data_dir, prompts.parent)}
    work.mkdir(parents=True, exist_ok=True)
    resumed = work / "resumed"
    if script == "capibara-exp":  # a copy of the run resumes: its checkpoint_4 must stay
        shutil.copytree(run, resumed, symlinks=True)
    kept = snapshot(resumed / "checkpoint_4") if script == "capibara-exp" else None
    out = call(script, commands(run, data_dir, prompts, work)[script], work, rlimits)
    found = problems(script, out)
    found += [f"input {p} changed" for p, before in inputs.items() if snapshot(p) != before]
    if kept is not None:
        found += checkpoints_kept(resumed, kept)
    began = {"capibara-exp-merge": work / "merged", "capibara-exp-data": work / "data"}
    if out.returncode != 0 and script in began and began[script].exists():
        found.append(f"failed, but left {began[script]} behind")  # new output dirs go again
    staged = [p.name for p in work.glob(".out.jsonl*")]  # generate's staging files
    if out.returncode != 0 and script == "capibara-exp-generate" and staged:
        found.append(f"failed, but left {staged} behind")
    return out, found


def prepare(root: Path, data_dir: Path | None = None) -> tuple[Path, Path, Path]:
    """A finished tiny run (checkpoints 2 and 4), its data dir, a prompts file."""
    data_dir, run = data_dir or root / "data", root / "run"
    out = call("capibara-exp", [*TINY, f"data_dir={data_dir}", f"model_dir={run}"], root)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    (root / "prompts").mkdir()
    prompts = root / "prompts" / "prompts.txt"
    prompts.write_text("def add(a, b):\nprint(\n")
    return run, data_dir, prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scripts", nargs="*", default=sorted(MODULE))
    parser.add_argument("--limits", nargs="*", default=sorted(LIMITS))
    parser.add_argument("--disk", default="2m", help="the tmpfs's size ('' for none)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="capibara-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    inputs = (root / "run", root / "data", root / "prompts" / "prompts.txt")
    if not inputs[0].is_dir():
        inputs = prepare(root)
    failed, start = 0, time.perf_counter()
    for script in args.scripts:
        for name in args.limits:
            work = root / "work" / f"{script}-{name.replace('=', '')}"
            shutil.rmtree(work, ignore_errors=True)
            out, found = one_case(script, [LIMITS[name]], *inputs, work)
            failed += _report(script, name, out, found)
        if args.disk:
            work = root / "work" / f"{script}-tmpfs"
            shutil.rmtree(work, ignore_errors=True)
            with tiny_disk(work, args.disk) as why_not:
                if why_not:
                    print(f"[--] {script} tmpfs: not mounted: {why_not}")
                    continue
                out, found = one_case(script, [], *inputs, work)
            failed += _report(script, f"tmpfs size={args.disk}", out, found)
    print(f"{failed} failing case(s), {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


def _report(script: str, name: str, out: subprocess.CompletedProcess, found: list[str]) -> bool:
    last = (out.stderr.strip().splitlines() or [""])[-1][:160]
    print(f"[{'FAIL' if found else 'ok'}] {script} {name}: exit {out.returncode}: "
          f"{last}{''.join(chr(10) + '    ' + f for f in found)}", flush=True)
    return bool(found)


if __name__ == "__main__":
    sys.exit(main())
