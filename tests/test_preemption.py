"""Preemption with several processes: SIGTERM to one of two processes (JAX's preemption
service tells the other), both save the same step and exit 75, and both resume from it
(process 0 verifies the checkpoint and every process restores the step it names)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capibara_exp.base.errors import PREEMPTED_EXIT_CODE
from capibara_exp.runtime import checkpoints, integrity
from tests.test_distributed import _free_port

STEPS = 60  # room for the notice to reach the other host's sync point, few to resume
RUN = ["debug=fast", f"trainer.train_steps={STEPS}", f"trainer.eval_period={STEPS}",
       "trainer.stats_period=1", f"checkpoint.checkpoint_period={STEPS}"]


def _process(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return subprocess.Popen([sys.executable, "-m", "capibara_exp.cli", *args], cwd=cwd, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigterm_to_one_host_saves_the_same_step_on_both(tmp_path, data_dir) -> None:
    model_dir = tmp_path / "run"
    logs = [tmp_path / f"p{i}.log" for i in range(2)]

    def start() -> list[subprocess.Popen]:
        common = [*RUN, f"model_dir={model_dir}", "distributed.mode=explicit",
                  "distributed.num_processes=2",
                  f"distributed.coordinator_address=localhost:{_free_port()}"]
        return [_process([*common, f"distributed.process_id={i}"], tmp_path, logs[i])
                for i in range(2)]

    procs = start()
    deadline = time.monotonic() + 600
    while f"step 3/{STEPS}" not in logs[0].read_text() and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # the host that reports nothing
    codes = [p.wait(timeout=600) for p in procs]
    out = logs[0].read_text()
    assert codes == [PREEMPTED_EXIT_CODE] * 2, (codes, out[-3000:], logs[1].read_text()[-2000:])
    line = next(ln for ln in out.splitlines() if "preempted by" in ln)
    step = int(line.split("after step ")[1].split(":")[0])
    assert "a preemption notice" in line and 3 <= step < STEPS
    assert checkpoints.steps(model_dir) == [step]  # one step, written by both together
    step_dir = checkpoints.step_dir(model_dir, step)
    assert integrity.verify_checkpoint(step_dir) == []
    assert integrity.manifest_info(step_dir)["kind"] == "preemption"
    procs = start()
    assert [p.wait(timeout=900) for p in procs] == [0, 0], logs[0].read_text()[-3000:]
    out = logs[0].read_text()
    assert f"restored {model_dir}/checkpoint_{step} (a preemption save)" in out
    assert f"compiled and ran step {step + 1}; training to step {STEPS}" in out
    assert checkpoints.steps(model_dir) == [step, STEPS]
