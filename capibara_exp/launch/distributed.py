"""JAX's multi-controller runtime for the local engine: every process runs the same command
and gin, and `jax.distributed.initialize` joins them into one set of global devices.

Settings come from the `distributed` config (conf/config.yaml): explicit coordinator,
process count and id (several processes on one or more machines), or `auto`, where JAX
reads them from the cluster (TPU VM slices, SLURM).
"""

from __future__ import annotations

from typing import Any

from capibara_exp.errors import ConfigError

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


def initialize(settings: Any) -> bool:
    """Join the processes (before any other JAX use); True when distributed."""
    if settings.mode == "single":
        return False
    import jax

    if settings.mode == "auto":
        jax.distributed.initialize()
        return True
    local = list(settings.local_device_ids) if settings.get("local_device_ids") else None
    jax.distributed.initialize(coordinator_address=settings.coordinator_address,
                               num_processes=int(settings.num_processes),
                               process_id=int(settings.process_id), local_device_ids=local)
    return True


def t5x_flags(settings: Any) -> list[str]:
    """T5X's own flags for the same settings (t5x.train calls jax.distributed itself)."""
    if settings.mode != "explicit":
        return []
    return ["--multiprocess_gpu", f"--coordinator_address={settings.coordinator_address}",
            f"--process_count={settings.num_processes}", f"--process_index={settings.process_id}"]
