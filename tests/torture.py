"""Torture the running program: kill -9 at random moments, random bit flips in the latest
checkpoint, NaN at every kind of save, SIGTERM at random steps, killed workers under the
engine=tpu_vm launch script's restart loop, poisoned and absurd merge parameters.

    python -m tests.torture            # the small version (what tests/test_torture.py runs)
    python -m tests.torture --full     # 20 kills, 40 flips, 10 SIGTERMs, 5 restarts, ...
    python -m tests.torture --full --seed 7 --out /tmp/torture

Every trial is compared with one straight run of the same tiny model (the reference): a
resume must give its state bitwise. One line per trial, a table, exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from capibara_exp.runtime import checkpoints, integrity

STEPS = 24
RUN = ["model.emb_dim=32", "model.num_heads=2", "model.head_dim=16", "model.mlp_dim=64",
       "data.batch_size=4", "data.task_feature_lengths={targets: 64}", "trainer.eval_steps=1",
       "trainer.eval_period=8", "trainer.stats_period=1", "schedule.warmup_steps=2",
       f"trainer.train_steps={STEPS}", "checkpoint.checkpoint_period=2",
       "checkpoint.checkpoints_to_keep=null"]
SMALL = {"kills": 1, "flips": 3, "sigterms": 1, "sigints": 0, "restarts": 0}
FULL = {"kills": 20, "flips": 40, "sigterms": 10, "sigints": 2, "restarts": 5}
# The reference saves every step, so any step a trial stops at has its state to compare.
REFERENCE = ["checkpoint.checkpoint_period=1"]


def render(model_dir: Path, *overrides: str) -> Path:
    """config.gin of the torture run in model_dir, as the CLI writes it."""
    from capibara_exp import experiment
    from tests.conftest import compose_config

    cfg = compose_config([f"model_dir={model_dir}", *RUN, *overrides])
    return experiment.write_gin(cfg, model_dir, {})


def train_here(gin: Path, **train_kwargs) -> tuple[str, object]:
    """Train config.gin in this process; (its progress lines, the result or the exception).
    With train_kwargs, config.gin is already parsed and they replace its bindings."""
    import gin as gin_lib
    from capibara_exp.runtime import gin_utils, train_script

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            if train_kwargs:
                result = gin_lib.get_configurable(train_script.train)(**train_kwargs)
            else:
                result = gin_utils.run_train(gin)
        except (Exception, SystemExit) as exc:  # the trial looks at what was raised
            result = exc
    return err.getvalue(), result


def worker(gin: Path, log: Path) -> subprocess.Popen:
    """The local engine's worker entry on config.gin, in its own process."""
    return subprocess.Popen([sys.executable, "-m", "capibara_exp.runtime", str(gin)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def tree(step_dir: Path) -> dict:
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(step_dir.absolute() / checkpoints.ITEM)


def same(a: dict, b: dict) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb, strict=True))


def same_step(run: Path, reference: Path, step: int) -> bool:
    return same(tree(checkpoints.step_dir(run, step)), tree(checkpoints.step_dir(reference, step)))


def nonfinite_checkpoints(root: Path) -> list[str]:
    """Committed checkpoints under root (not the quarantined ones) holding NaN/Inf."""
    bad = []
    for step_dir in sorted(root.rglob(f"{checkpoints.STEP_PREFIX}_*")):
        if (integrity.CORRUPT_DIR in step_dir.parts or not step_dir.is_dir()
                or "foreign" in step_dir.parts or not (step_dir / checkpoints.ITEM).is_dir()):
            continue
        if not checkpoints.all_finite(tree(step_dir)):
            bad.append(str(step_dir))
    return bad


class Tally:
    """Trials by case: passed or failed, with a line each."""

    def __init__(self) -> None:
        self.results: dict[str, list[bool]] = {}

    def record(self, case: str, ok: bool, line: str) -> bool:
        self.results.setdefault(case, []).append(ok)
        print(f"[{'ok' if ok else 'FAIL'}] {case}: {line}", flush=True)
        return ok

    def table(self) -> str:
        return "\n".join(f"  {case:28s} {sum(r)}/{len(r)}" for case, r in self.results.items())

    @property
    def failed(self) -> int:
        return sum(not ok for r in self.results.values() for ok in r)


# ---- kill -9 at random moments -------------------------------------------------------------

def kill_trial(root: Path, reference: Path, rng: random.Random, tally: Tally, i: int) -> None:
    """Start, kill -9 at a random moment, check the newest verified checkpoint against the
    reference, then train on to the end and compare the final state bitwise."""
    run = root / f"kill{i}"
    gin = render(run)
    proc = worker(gin, run / "worker.log")
    started = time.perf_counter()
    if rng.random() < 0.75:  # mostly while training and saving, sometimes while starting up
        _wait_for(run / "worker.log", "compiled and ran step", proc, timeout=120)
    time.sleep(rng.uniform(0.0, 1.5))
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    at = time.perf_counter() - started
    found = checkpoints.steps(run)
    out, result = train_here(gin)
    restored = re.search(r"restored .*checkpoint_(\d+)", out)
    step = int(restored.group(1)) if restored else 0
    ok = isinstance(result, tuple) and (not restored or same_step(run, reference, step))
    ok = ok and same_step(run, reference, STEPS)
    tally.record("kill -9, bitwise resume", ok,
                 f"killed at {at:.2f}s (exit {proc.returncode}), checkpoints {found}, resumed "
                 f"from step {step}, final {'equal' if ok else 'DIFFERS'}")


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end and proc.poll() is None:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.05)


# ---- bit flips in the latest checkpoint -----------------------------------------------------

def flip_trial(root: Path, reference: Path, rng: random.Random, tally: Tally, i: int) -> None:
    """Flip one random bit of one random file of the latest checkpoint; the run must move it
    aside, fall back to the previous one and end with the reference's state."""
    run = root / f"flip{i}"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("config.gin"))
    latest = checkpoints.step_dir(run, STEPS)
    files = sorted(p for p in latest.rglob("*") if p.is_file())
    victim = rng.choice(files)
    data = bytearray(victim.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    victim.write_bytes(bytes(data))
    out, result = train_here(render(run))
    moved = run / integrity.CORRUPT_DIR / latest.name
    said = re.search(rf"checkpoint_{STEPS} failed verification .*; moved to {moved}; falling "
                     rf"back to checkpoint_{STEPS - 1}", out)
    ok = bool(said) and (moved / integrity.REASON_FILE).is_file() and isinstance(result, tuple)
    ok = ok and same_step(run, reference, STEPS)
    tally.record("bit flip detected, fallback", ok,
                 f"{victim.relative_to(latest)} byte {at}: "
                 + (said.group(0)[:90] if said else f"NOT CAUGHT: {out[-300:]!r} {result!r}"))


# ---- NaN at every kind of save --------------------------------------------------------------

def nan_trial(root: Path, kind: str, tally: Tally) -> None:
    """Params turn NaN at a step that saves (periodic, extra, final, preemption, stop): the
    save is refused, the error names the newest finite checkpoint, none is non-finite."""
    from capibara_exp.base.errors import TrainingDiverged

    run, poison_at = root / f"nan_{kind}", {"periodic": 4, "extra": 5, "final": 8,
                                            "preemption": 5, "stop": 3, "fresh": 2}[kind]
    extra = ["gin_bindings=['utils.SaveCheckpointConfig.checkpoint_steps = [5]']"] \
        if kind == "extra" else ["trainer.train_steps=8"] if kind == "final" else []
    gin = render(run, *extra)
    out, result = train_here(gin, **_poisoned(gin, poison_at, kind))
    newest = f"checkpoint_{poison_at - 1 - (poison_at - 1) % 2}" if poison_at > 2 else None
    named = ("no checkpoint exists" in str(result)) if newest is None else (
        f"the newest finite checkpoint is {run}/{newest}" in str(result))
    ok = (isinstance(result, TrainingDiverged) and f"checkpoint_{poison_at} not written" in
          str(result) and named and not nonfinite_checkpoints(run)
          and poison_at not in checkpoints.steps(run))
    tally.record("NaN never saved", ok, f"{kind} save at step {poison_at}: {str(result)[:160]}")


def _poisoned(gin: Path, step: int, kind: str) -> dict:
    """train's arguments with a trainer whose params turn NaN after `step` (and, for the
    preemption kind, a SIGTERM at that step; for the stop kind, an action that stops)."""
    import gin as gin_lib
    from capibara_exp.runtime import gin_utils, train_script
    from capibara_exp.runtime.trainer import BaseAction

    gin_utils.parse(gin)
    bound = gin_lib.get_bindings(train_script.train)
    base = bound["trainer_cls"]

    class Poisoned(base):
        def train_step(self, state, batch):
            state, metrics = super().train_step(state, batch)
            if int(jax.device_get(state.step)) == step:
                state = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
                if kind == "preemption":
                    os.kill(os.getpid(), signal.SIGTERM)
            return state, metrics

    class StopAt(BaseAction):
        def run(self, train_state, metrics_by_task):
            return int(jax.device_get(train_state.step)) == step

    kwargs = {"trainer_cls": Poisoned}
    if kind == "stop":
        kwargs.update(actions={"TRAIN_EVAL": [StopAt()]}, eval_period=1)
    return kwargs


def guard_trial(root: Path, tally: Tally) -> None:
    """nan_guard=skip with a limit of 2 and reports only at the end: the guard stops at the
    step the limit is reached, and nothing after it is saved."""
    from capibara_exp.base.errors import TrainingDiverged

    run = root / "guard"
    gin = render(run, "nan_guard=skip", "nan_guard.max_consecutive_skips=2",
                 "trainer.stats_period=12", "schedule.base_learning_rate=1e30",
                 "schedule.lr_factors=constant", "optimizer.grad_clip_norm=1e30")
    out, result = train_here(gin)
    found = re.search(r"for 2 steps in a row .* at step (\d+)", str(result))
    ok = (isinstance(result, TrainingDiverged) and bool(found) and not nonfinite_checkpoints(run)
          and all(s < int(found.group(1)) for s in checkpoints.steps(run)))
    tally.record("NaN guard on every step", ok, str(result)[:200])


# ---- SIGTERM at random steps ----------------------------------------------------------------

def sigterm_trial(root: Path, reference: Path, rng: random.Random, tally: Tally, i: int,
                  sig: int = signal.SIGTERM) -> None:
    """SIGTERM while training: exit 75 after saving the step in progress, which equals the
    reference's; no finished step is lost; resuming ends bitwise on the reference."""
    from capibara_exp.base.errors import PREEMPTED_EXIT_CODE

    run = root / f"sigterm{i}"
    gin = render(run, "checkpoint.checkpoint_period=4")
    proc = worker(gin, run / "worker.log")
    _wait_for(run / "worker.log", "compiled and ran step", proc, timeout=120)
    time.sleep(rng.uniform(0.0, 0.6))
    proc.send_signal(sig)
    proc.wait(timeout=120)
    log = (run / "worker.log").read_text()
    said = re.search(r"preempted by (\w+) after step (\d+)", log)
    step = int(said.group(2)) if said else -1
    reported = [int(m) for m in re.findall(r"^capibara-exp: step (\d+)/", log, re.M)]
    ok = (proc.returncode == PREEMPTED_EXIT_CODE and step in checkpoints.steps(run)
          and all(s <= step for s in reported) and same_step(run, reference, step))
    _, result = train_here(gin)
    ok = ok and isinstance(result, tuple) and same_step(run, reference, STEPS)
    tally.record("SIGTERM/SIGINT loses no step", ok,
                 f"exit {proc.returncode}, {said.group(0) if said else 'no preemption line'}, "
                 f"last report {max(reported, default=0)}, resumed to the reference")


# ---- killed workers under the launch script -------------------------------------------------

WRAPPER = """#!/usr/bin/env bash
# The worker's python on the fake slice: one host, so no jax.distributed.
echo $$ > "$FAKE_SLICE_DIR/python.pid"
args=("$@"); args=("${{args[@]/--distributed=auto/--distributed=single}}")
exec {python} "${{args[@]}}"
"""


def restart_trial(root: Path, reference: Path, rng: random.Random, tally: Tally,
                  kills: int) -> None:
    """The launch script restarts a worker killed `kills` times at random moments; the job
    then ends with the reference's state."""
    from tests.fakes import executable, fake_slice, launch_script

    slice_dir = root / "slice"
    run = slice_dir / "shared" / "run"
    gin = render(run)
    env = fake_slice(slice_dir)
    python = executable(slice_dir / "python", WRAPPER.format(python=sys.executable))
    script = launch_script(slice_dir, gin, run, str(python), max_restarts=kills,
                           restart_backoff_s=0)
    out = slice_dir / "job.log"
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=out.open("w"),
                           stderr=subprocess.STDOUT)
    pid_file, killed = slice_dir / "python.pid", 0
    while killed < kills and job.poll() is None:
        pid = _new_pid(pid_file, job)
        trained = out.read_text().count("compiled and ran step")
        if rng.random() < 0.5:  # while it trains: a few steps in
            _wait_for_count(out, "compiled and ran step", trained + 1, job)
            time.sleep(rng.uniform(0.0, 0.3))
        else:  # while it starts up
            time.sleep(rng.uniform(0.5, 4.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
        pid_file.unlink(missing_ok=True)
    job.wait(timeout=900)
    log = (slice_dir / "launch_tpu_vm.log").read_text()
    restarts = len(re.findall(r"restart \d+ of", log))
    ok = job.returncode == 0 and restarts == killed == kills and same_step(run, reference, STEPS)
    tally.record("killed-worker restarts", ok,
                 f"{killed} kills, {restarts} restarts logged, exit {job.returncode}, final "
                 f"{'equal' if ok else 'DIFFERS'}")


def _wait_for_count(log: Path, text: str, count: int, proc: subprocess.Popen) -> None:
    while proc.poll() is None and log.read_text().count(text) < count:
        time.sleep(0.05)


def _new_pid(pid_file: Path, job: subprocess.Popen) -> int:
    while job.poll() is None:
        if pid_file.exists() and pid_file.read_text().strip():
            return int(pid_file.read_text())
        time.sleep(0.05)
    return -1


# ---- the whole torture ----------------------------------------------------------------------

def torture(root: Path, counts: dict[str, int], seed: int, console: bool = False) -> Tally:
    from tests import torture_inputs as bad  # imports this module: not at the top

    rng, tally = random.Random(seed), Tally()
    reference = root / "reference"
    _, result = train_here(render(reference, *REFERENCE))
    assert isinstance(result, tuple), f"the reference run failed: {result!r}"
    cases: list[Callable[[], None]] = [
        *(lambda i=i: kill_trial(root, reference, rng, tally, i) for i in range(counts["kills"])),
        *(lambda i=i: flip_trial(root, reference, rng, tally, i) for i in range(counts["flips"])),
        *(lambda k=k: nan_trial(root, k, tally)
          for k in ("periodic", "extra", "final", "preemption", "stop", "fresh")),
        lambda: guard_trial(root, tally),
        *(lambda i=i: sigterm_trial(root, reference, rng, tally, i)
          for i in range(counts["sigterms"])),
        *(lambda i=i: sigterm_trial(root, reference, rng, tally, counts["sigterms"] + i,
                                    signal.SIGINT) for i in range(counts["sigints"])),
        *([lambda: restart_trial(root, reference, rng, tally, counts["restarts"])]
          if counts["restarts"] else []),
        lambda: bad.merge_trials(root, reference, tally, console),
        *([lambda: bad.absurd_trials(root, tally)] if console else []),
        lambda: bad.poisoned_candidates(root, reference, tally),
    ]
    for case in cases:
        case()
    written = nonfinite_checkpoints(root)
    tally.record("no non-finite state written", not written,
                 f"{len(written)} non-finite: {written[:3]}")
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the issue's counts (about 30 minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here")
    args = ap.parse_args()
    os.environ.setdefault("CAPIBARA_DATA_DIR", str(Path("data").absolute()))
    root = args.out or Path(tempfile.mkdtemp(prefix="capibara-torture-"))
    # One compilation cache for this process and the workers it starts: the many runs of
    # one tiny model compile its steps once (a cached program computes the same numbers).
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    t0 = time.perf_counter()
    tally = torture(root, FULL if args.full else SMALL, args.seed, console=args.full)
    print(f"torture ({'full' if args.full else 'small'}, seed {args.seed}, "
          f"{time.perf_counter() - t0:.0f}s, runs in {root}):\n{tally.table()}")
    sys.exit(1 if tally.failed else 0)


if __name__ == "__main__":
    main()
