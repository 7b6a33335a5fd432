"""JAX's multi-controller runtime for the local engine: every process runs the same command
and gin, and `jax.distributed.initialize` joins them into one set of global devices.

Settings come from the `distributed` config (conf/config.yaml): explicit coordinator,
process count and id (several processes on one or more machines), or `auto`, where JAX
reads them from the cluster (TPU VM slices, SLURM); and the bounds within which a late or
dead process stops them all (JAX's initialization, heartbeat and shutdown timeouts).

A process that is late or dies makes every process exit within those bounds with one line
naming it and exit status 75, from which the launch script's restart loop resumes
(peers.py): JAX's own ending (a hang in a collective, then an abort) names nothing.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from capibara_exp.base.errors import PREEMPTED_EXIT_CODE, ConfigError

TIMEOUTS = {"initialization_timeout_s": "initialization_timeout",  # conf key -> JAX's keyword
            "heartbeat_timeout_s": "heartbeat_timeout_seconds",
            "shutdown_timeout_s": "shutdown_timeout_seconds"}

MODES = ("single", "explicit", "auto")


def check(settings: Any, model_dir_is_run_dir: bool) -> None:
    """Settings errors before anything starts, naming the keys."""
    mode = settings.mode
    if mode not in MODES:
        raise ConfigError(f"distributed.mode: '{mode}' is not one of {list(MODES)}")
    if mode != "explicit":
        return
    missing = [k for k in ("coordinator_address", "num_processes", "process_id")
               if settings.get(k) is None]
    if missing:
        keys = ", ".join(f"distributed.{k}" for k in missing)
        raise ConfigError(f"distributed.mode=explicit needs {keys}")
    if not 0 <= int(settings.process_id) < int(settings.num_processes):
        raise ConfigError(f"distributed.process_id={settings.process_id} is not in "
                          f"[0, distributed.num_processes={settings.num_processes})")
    if model_dir_is_run_dir and int(settings.num_processes) > 1:
        raise ConfigError("distributed training: every process must write one model dir; "
                          "set model_dir to a directory all processes share (the default, "
                          "a time-stamped run dir, differs per process)")


def timeouts(settings: Any) -> dict[str, int]:
    """jax.distributed.initialize's timeouts from the settings (JAX's defaults where unset)."""
    return {jax_key: int(settings[key]) for key, jax_key in TIMEOUTS.items()
            if settings.get(key) is not None}


def initialize(settings: Any) -> bool:
    """Join the processes (before any other JAX use); True when distributed. A process
    that does not join within the initialization timeout ends this one (exit 75)."""
    if settings.mode == "single":
        return False
    import jax

    kwargs = timeouts(settings)
    if settings.mode == "explicit":
        local = list(settings.local_device_ids) if settings.get("local_device_ids") else None
        kwargs.update(coordinator_address=settings.coordinator_address,
                      num_processes=int(settings.num_processes),
                      process_id=int(settings.process_id), local_device_ids=local)
    where = (f"process {settings.process_id} of {settings.num_processes}"
             if settings.mode == "explicit" else "this process")
    timeout_s = kwargs.get("initialization_timeout", 300)
    late = f"{where}: the processes did not all join within " \
           f"distributed.initialization_timeout_s={timeout_s} s"
    # JAX aborts the process at its own deadline, naming nobody: say it first, just before.
    timer = threading.Timer(max(0.5, timeout_s - 1.0), stop, args=(late,))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as err:  # the coordinator refused, or JAX raised at its deadline
        stop(f"{late} ({first_line(err)})")
    finally:
        timer.cancel()
    return True


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def stop(line: str) -> None:
    """One line, then exit 75 at once: not through Python's exit, whose handlers include
    JAX's shutdown barrier, which waits for the lost process (shutdown_timeout_s)."""
    import os

    print(f"capibara-exp: {line}; exiting {PREEMPTED_EXIT_CODE}: a restart resumes from the "
          "newest checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(PREEMPTED_EXIT_CODE)


def t5x_flags(settings: Any) -> list[str]:
    """T5X's own flags for the same settings (t5x.train calls jax.distributed itself)."""
    if settings.mode != "explicit":
        return []
    return ["--multiprocess_gpu", f"--coordinator_address={settings.coordinator_address}",
            f"--process_count={settings.num_processes}", f"--process_index={settings.process_id}"]
