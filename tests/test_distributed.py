"""Multi-process training (jax.distributed) and the TPU VM launch script (engine=tpu_vm)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

RUN = ["debug=fast", "trainer.train_steps=2", "trainer.eval_period=2", "trainer.stats_period=1",
       "checkpoint.checkpoint_period=1"]


def _capibara(args: list[str], cwd: Path, devices: int) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen([sys.executable, "-m", "capibara_exp.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    return out


def _records(model_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def _params(model_dir: Path, step: int) -> dict:
    """Every leaf of a checkpoint as host arrays, whatever devices wrote it."""
    from capibara_exp.consensus import store

    cand = store.candidate_from_path(model_dir / f"checkpoint_{step}")
    with store.LeafReader() as reader:
        return {path: reader.read(cand, path, info)
                for path, info in store.leaf_index(cand).items() if path[0] == "target"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.entry
def test_two_processes_of_four_devices_train_as_one_of_eight(tmp_path, data_dir):
    one = tmp_path / "one"
    _finish(_capibara([*RUN, f"model_dir={one}"], tmp_path, devices=8))
    two = tmp_path / "two"
    common = [*RUN, f"model_dir={two}", "distributed.mode=explicit", "distributed.num_processes=2",
              f"distributed.coordinator_address=localhost:{_free_port()}"]
    procs = [_capibara([*common, f"distributed.process_id={i}"], tmp_path, devices=4)
             for i in range(2)]
    outputs = [_finish(p) for p in procs]
    assert "finished at step 2" in outputs[0]
    assert "finished at step 2" not in outputs[1]  # process 1 reports nothing

    # Training moved the parameters, and both set-ups moved them alike.
    before, after = _params(one, 1), _params(one, 2)
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    for step in (1, 2):
        want, got = _params(one, step), _params(two, step)
        assert sorted(want) == sorted(got)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    want_m = {(r["split"], r["step"]): r["loss"] for r in _records(one)}
    got_m = {(r["split"], r["step"]): r["loss"] for r in _records(two)}
    assert want_m.keys() == got_m.keys() and ("train_eval", 2) in want_m
    for key, loss in want_m.items():
        assert got_m[key] == pytest.approx(loss, rel=1e-6), key


def test_distributed_settings_errors_name_the_keys(tmp_path):
    from omegaconf import OmegaConf

    from capibara_exp.base.errors import ConfigError
    from capibara_exp.launch import distributed

    def settings(**kw):
        base = {"mode": "explicit", "coordinator_address": "localhost:1", "num_processes": 2,
                "process_id": 0, "local_device_ids": None}
        return OmegaConf.create({**base, **kw})

    distributed.check(settings(), model_dir_is_run_dir=False)
    with pytest.raises(ConfigError, match="distributed.mode: 'on' is not one of"):
        distributed.check(settings(mode="on"), False)
    with pytest.raises(ConfigError, match="needs distributed.coordinator_address"):
        distributed.check(settings(coordinator_address=None), False)
    with pytest.raises(ConfigError, match=r"process_id=2 is not in \[0, .*num_processes=2\)"):
        distributed.check(settings(process_id=2), False)
    with pytest.raises(ConfigError, match="set model_dir to a directory all processes share"):
        distributed.check(settings(), model_dir_is_run_dir=True)
    assert distributed.t5x_flags(settings(process_id=1)) == [
        "--multiprocess_gpu", "--coordinator_address=localhost:1", "--process_count=2",
        "--process_index=1"]


TPU_VM = ["experiment=moe_e2b_base", "engine=tpu_vm", "engine.tpu_name=my-slice",
          "engine.zone=us-west4-a", "engine.workdir=/mnt/shared"]


@pytest.mark.parametrize("runtime", ["t5x", "local"])
def test_tpu_vm_dry_run_writes_the_launch_script(tmp_path, runtime):
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", *TPU_VM,
                          f"engine.runtime={runtime}", "hydra.run.dir=run"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    script = (tmp_path / "run" / "launch_tpu_vm.sh").read_text()
    assert out.stdout.strip() == script.strip()  # the dry run prints what it wrote
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    gin_text = (tmp_path / "run" / "config.gin").read_text()
    header = "from t5x import utils" if runtime == "t5x" else "runtime import utils"
    assert header in gin_text
    # v5e-64: 64 chips on 16 TPU VMs of 4 chips (as libtpu describes the slice), one command
    # on every worker, the same gin, shared dirs.
    assert "--accelerator-type=v5litepod-64" in script and "16 worker host(s)" in script
    lines = [line.strip() for line in script.splitlines() if line.strip().startswith("gcloud")]
    build = [line for line in lines if "--worker=0" in line]
    lines = [line for line in lines if line not in build]
    assert len(lines) == 3 and all("--worker=all" in line for line in lines)
    # what the run reads is built once, on worker 0, into the shared data dir, before the job
    assert len(build) == 1 and "capibara_exp.cli.data data_dir=/mnt/shared/data" in build[0]
    assert script.index(build[0]) < script.index(lines[2])
    assert "while true; do" in script and "MAX_RESTARTS=3" in script  # the job restarts
    assert "scp" in lines[1] and str(tmp_path / "run" / "config.gin") in lines[1]
    remote_gin = lines[1].split("my-slice:")[1].split()[0]
    assert remote_gin.startswith("/mnt/shared/moe_e2b_base/run/")
    assert f"--gin_file={remote_gin}" in lines[2] or f"runtime {remote_gin}" in lines[2]
    assert "CAPIBARA_DATA_DIR=/mnt/shared/data" in lines[2]
    model_dir = [line for line in gin_text.splitlines() if line.startswith("MODEL_DIR = ")][-1]
    assert "'/mnt/shared/moe_e2b_base/" in model_dir


def test_tpu_vm_workers_run_under_the_experiments_libtpu_flags(tmp_path):
    """The worker command exports the experiment's libtpu flags after any the worker's
    environment holds; bash runs the exports as written (quoting included)."""
    flags = "--xla_enable_async_all_gather=true --xla_tpu_megacore_fusion_allow_ags=false"
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", *TPU_VM,
                          f"libtpu_init_args='{flags}'", "hydra.run.dir=run"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    script = (tmp_path / "run" / "launch_tpu_vm.sh").read_text()
    job = next(line for line in script.splitlines()
               if "--worker=all" in line and "--command=" in line and "&&" in line)
    command = next(a for a in shlex.split(job) if a.startswith("--command="))
    exports = [step for step in command.removeprefix("--command=").split(" && ")
               if step.startswith("export ")]
    probe = " && ".join([*exports, 'printf %s "$LIBTPU_INIT_ARGS"'])
    for before, want in ((None, flags), ("--xla_user_flag=1", f"--xla_user_flag=1 {flags}")):
        env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
        if before:
            env["LIBTPU_INIT_ARGS"] = before
        got = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True)
        assert got.stdout == want


def test_tpu_vm_settings_errors(tmp_path):
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "capibara_exp.cli", *TPU_VM, *extra],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)

    out = run("topology=cpu")
    assert out.returncode == 2 and "engine=tpu_vm needs a TPU slice in `topology`" in out.stderr
    out = run("engine.workdir=relative/dir")
    assert out.returncode == 2
    assert "engine.workdir=relative/dir: give the absolute path" in out.stderr
    out = run("model_dir=/elsewhere/run")
    assert out.returncode == 2
    assert "model_dir=/elsewhere/run is not on the workers' shared" in out.stderr


# ----------------------------------------------------------------------------- faults

FAULT_RUN = ["debug=fast", "trainer.train_steps=30", "trainer.eval_period=30",
             "trainer.stats_period=5", "checkpoint.checkpoint_period=10",
             "distributed.mode=explicit", "distributed.num_processes=2",
             "distributed.heartbeat_timeout_s=10", "distributed.peer_check_s=1"]


def _pair(model_dir: Path, cache: Path, tmp_path: Path) -> list[subprocess.Popen]:
    """Two processes of one device each, as the docs' command starts them on two hosts."""
    common = [*FAULT_RUN, f"model_dir={model_dir}", f"compilation_cache_dir={cache}",
              f"distributed.coordinator_address=localhost:{_free_port()}"]
    return [_capibara([*common, f"distributed.process_id={i}"], tmp_path, devices=1)
            for i in range(2)]


def _compiled_step(output: str) -> bool:
    return "compiling jit(_step)" in output


@pytest.mark.slow
def test_two_processes_survive_a_warm_cache_and_a_killed_peer_then_resume_bitwise(
        tmp_path: Path, data_dir: Path) -> None:
    cache = tmp_path / "xla"
    # Cold cache: both compile; process 0 writes the cache (JAX writes from process 0 only).
    whole = tmp_path / "whole"
    cold = [_finish(p) for p in _pair(whole, cache, tmp_path)]
    assert list(cache.glob("jit__step-*")), "process 0 wrote no cache entry"
    assert [_compiled_step(out) for out in cold] == [True, True]

    # Warm cache: the processes agree on it (process 0 alone would read its step from the
    # cache and run its first collective a compile ahead of process 1): both compile alike.
    # Process 1 is killed once a checkpoint exists; process 0 says so in one line, exits 75.
    cut = tmp_path / "cut"
    procs = _pair(cut, cache, tmp_path)
    deadline = time.monotonic() + 900
    while not (cut / "checkpoint_10").is_dir():
        assert time.monotonic() < deadline and procs[0].poll() is None, "no checkpoint 10"
        time.sleep(0.2)
    procs[1].kill()
    killed_out, _ = procs[1].communicate(timeout=60)
    out, _ = procs[0].communicate(timeout=600)  # a hang here is the failure
    assert procs[0].returncode == 75, out[-3000:]
    # The cause, whichever sees it first: the step's collective (Gloo: connection reset) or
    # the peer's counter in the coordination service, still for half the heartbeat timeout.
    said = [line for line in out.splitlines() if line.startswith("capibara-exp: process 0 of 2: ")
            and "exiting 75: a restart resumes from the newest checkpoint" in line]
    assert len(said) == 1, out[-3000:]
    assert ("process 1 stopped for 5 s" in said[0]
            or "a collective with process 1 failed" in said[0]), said
    assert _compiled_step(out) == _compiled_step(killed_out), (out[-2000:], killed_out[-2000:])

    # The restart (as the launch script's loop runs it) resumes and ends where the
    # uninterrupted run did, bit for bit.
    resumed = [_finish(p) for p in _pair(cut, cache, tmp_path)]
    assert "finished at step 30" in resumed[0]
    want, got = _params(whole, 30), _params(cut, 30)
    assert sorted(want) == sorted(got) and any(
        not np.array_equal(_params(whole, 10)[k], want[k]) for k in want)
    for key in want:
        assert np.array_equal(got[key], want[key]), key


def test_distributed_timeouts_reach_jax(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from capibara_exp.launch import distributed
    from tests.conftest import compose_config

    settings = compose_config(["distributed.heartbeat_timeout_s=7"]).distributed
    assert distributed.timeouts(settings) == {"initialization_timeout": 300,
                                              "heartbeat_timeout_seconds": 7,
                                              "shutdown_timeout_seconds": 300}
    import inspect

    import jax

    accepted = inspect.signature(jax.distributed.initialize).parameters
    assert set(distributed.timeouts(settings)) <= set(accepted)
    assert distributed.timeouts(OmegaConf.create({"mode": "auto"})) == {}


def test_a_process_whose_peer_never_comes_exits_75_naming_the_timeout(tmp_path: Path) -> None:
    proc = _capibara([*RUN, f"model_dir={tmp_path / 'run'}", "distributed.mode=explicit",
                      "distributed.num_processes=2", "distributed.process_id=0",
                      f"distributed.coordinator_address=localhost:{_free_port()}",
                      "distributed.initialization_timeout_s=3"], tmp_path, devices=1)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 75, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith("capibara-exp: process 0 of 2")]
    assert len(said) == 1, out[-3000:]
    assert "did not all join within distributed.initialization_timeout_s=3 s" in said[0]
