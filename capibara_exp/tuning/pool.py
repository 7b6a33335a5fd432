"""Compile candidates in parallel: one process per worker, each with its own libtpu.

XLA's TPU compiler runs a compile on about one core (a moe_e2b_base candidate: about
100 s of CPU for 100 s of wall time), so a planner on an N-core host compiles N candidates
at once. Each worker is a spawned process that describes the topology once and then
compiles what it is sent: the candidate's composed config in, the compile's record and
HLO text out (with tune_mesh.early_stop, through a child process of its own that is killed
at buffer assignment: tuning/early.py). Workers cost their own host memory (1-5 GB each
for real models), so the pool is sized to the cores and to the memory available,
whichever is smaller.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

# Host memory one compile of a real model may take (docs/design.md: 0.9-5.3 GB measured).
WORKER_HOST_BYTES = 3 << 30


def default_workers() -> int:
    """One worker per core, fewer if the host's available memory cannot hold them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    by_memory = max(1, available // WORKER_HOST_BYTES) if available else cores
    return max(1, min(cores or 1, by_memory))


_DEVICES: list[Any] = []  # the worker's topology devices, described once


def _init(topology_name: str) -> None:
    from capibara_exp.base import environment, topologies
    from capibara_exp.tuning import tpu_slice as topology

    environment.import_tensorflow()  # the candidates' gin imports seqio: without its notices

    _DEVICES[:] = topology.devices(topologies.get(topology_name))


def _compile(plain_cfg: dict, chip: Any, reserve_bytes: float, early_stop: bool = False
             ) -> tuple[dict[str, Any], str]:
    from capibara_exp.tuning import aot, early

    cfg = OmegaConf.create(plain_cfg)
    if early_stop:  # in a child of this worker, stopped at buffer assignment
        compiled = early.compile_step(cfg, cfg.topology, chip, reserve_bytes)
    else:
        compiled = aot.compile_step(cfg, _DEVICES, chip, reserve_bytes)
    return compiled.record(), compiled.hlo_text


class CompilePool:
    """A pool of compile workers for one TPU topology (a context manager)."""

    def __init__(self, topology_name: str, workers: int):
        self.workers = workers
        context = multiprocessing.get_context("spawn")  # a fresh JAX in each worker
        self.executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init, initargs=(topology_name,))

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.executor.shutdown(cancel_futures=True)

    def submit(self, cfg: DictConfig, chip: Any, reserve_bytes: float, early_stop: bool = False
               ) -> concurrent.futures.Future:
        """Compile a config on the next free worker: a future of (record, HLO text)."""
        plain = OmegaConf.to_container(cfg, resolve=True)
        return self.executor.submit(_compile, plain, chip, reserve_bytes, early_stop)
