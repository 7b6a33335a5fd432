"""The processes of one multi-process run start together and stop together.

Starting: JAX writes its persistent compilation cache from process 0 only, and on CPU keys
every entry by the process that compiled it (the topology's fingerprint differs per
process), so a warm cache served process 0 alone: process 0 ran its first collective a
whole compile (45-57 s) before process 1, past Gloo's 30 s deadline for the peers to
connect. `agree_on_cache` compiles a tiny program over every process's devices with the
cache on; unless every process read it from the cache, or none did (a cold cache), the
cache is turned off for the run on every process, so that all compile alike. Where the
cache is shared and keyed alike on every host (a TPU slice's shared directory), every
process reads it and it stays on.

Stopping: every distributed.peer_check_s each process raises a counter of its own in JAX's
coordination service (its key-value store) and reads the others'; when one has not moved
for half distributed.heartbeat_timeout_s (the process died, or its machine did), or the
service itself is gone (process 0 died), the process prints one line naming the lost one
and exits 75. Without it the others hang in their next collective until the service's
heartbeat timeout aborts them with a stack trace that names no process: half that timeout
says it first.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from capibara_exp.base import private_apis
from capibara_exp.launch.distributed import first_line, stop

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
LOST_PEER = ("Gloo", "gloo", "heartbeat", "UNAVAILABLE", "Connection reset", "Connection closed")


def _probe_hit() -> bool:
    """Compile (never run) a small program over every process's devices; whether this
    process read it from the persistent cache."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    hits: list[str] = []

    def on_event(event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            hits.append(event)

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))
    shape = jax.ShapeDtypeStruct((jax.device_count(), 8), np.float32, sharding=sharding)
    jax.monitoring.register_event_listener(on_event)
    try:
        jax.jit(lambda x: x * 2.0 + 1.0, out_shardings=sharding).lower(shape).compile()
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    return bool(hits)


def agree_on_cache(cache_dir: str | None, timeout_s: int = 300) -> bool:
    """Keep the persistent compilation cache on only where every process reads it alike
    (see the module's docstring); whether it stays on. Call after initialize and after the
    cache is configured, before anything compiles."""
    import jax

    if not cache_dir or jax.process_count() == 1:
        return bool(cache_dir)
    client = private_apis.distributed_client()
    me, n = jax.process_index(), jax.process_count()
    client.key_value_set(f"capibara_exp/cache_hit/{me}", str(int(_probe_hit())))
    hits = [client.blocking_key_value_get(f"capibara_exp/cache_hit/{i}", timeout_s * 1000)
            for i in range(n)]
    if len(set(hits)) == 1:
        return True
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    readers = [str(i) for i, hit in enumerate(hits) if hit == "1"]
    print(f"capibara-exp: process {me} of {n}: the compilation cache {cache_dir} is off for "
          f"this run: process(es) {', '.join(readers)} read it and the others cannot (JAX "
          "writes it from process 0 only, keyed per process on CPU), so every process "
          "compiles", file=sys.stderr, flush=True)
    return False


def lost_peer(err: BaseException) -> bool:
    """Whether an error from a collective or the coordination service means a lost process."""
    return type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and any(
        word in str(err) for word in LOST_PEER)


class _Beats:
    """Each process's heartbeat in the coordination service's key-value store: a counter it
    raises every check, or "done" once it has left the watched block."""

    def __init__(self, client: Any, me: int, n: int, lost_after_s: float):
        self.client, self.me, self.n, self.lost_after_s = client, me, n, lost_after_s
        self.count = 0
        self.seen: dict[int, tuple[str, float]] = {}  # peer -> (its last beat, when it moved)

    def beat(self, value: str | None = None) -> None:
        self.count += 1
        self.client.key_value_set(f"capibara_exp/beat/{self.me}", value or str(self.count),
                                  allow_overwrite=True)

    def lost(self) -> list[int]:
        """The peers whose beat has not moved for lost_after_s (by this process's clock)."""
        now, lost = time.monotonic(), []
        for peer in range(self.n):
            if peer == self.me:
                continue
            try:
                value = self.client.key_value_try_get(f"capibara_exp/beat/{peer}")
            except Exception as err:  # a peer that has not beaten yet is not found
                if "NOT_FOUND" not in str(err):
                    raise
                value = ""
            last = self.seen.get(peer)
            if last is None or last[0] != value:
                self.seen[peer] = (value, now)
            elif value != "done" and now - last[1] > self.lost_after_s:
                lost.append(peer)
        return lost


@contextlib.contextmanager
def watched(settings: Any) -> Iterator[None]:
    """Stop this process with one line and exit 75 when another process of the run is lost
    while the block runs (see the module's docstring)."""
    import jax

    if jax.process_count() == 1:
        yield
        return
    me, n = jax.process_index(), jax.process_count()
    # Half JAX's heartbeat timeout: found and said before the service aborts everyone.
    timeout_s = int(settings.get("heartbeat_timeout_s") or 100)
    beats = _Beats(private_apis.distributed_client(), me, n, timeout_s / 2)
    where, done = f"process {me} of {n}", threading.Event()

    def watch() -> None:
        while not done.wait(float(settings.get("peer_check_s") or 5)):
            try:
                beats.beat()
                lost = beats.lost()
            except Exception as err:
                if not done.is_set():
                    stop(f"{where}: JAX's coordination service (process 0) is gone "
                         f"({first_line(err)})")
                return
            if lost and not done.is_set():
                stop(f"{where}: process {', '.join(map(str, lost))} stopped for "
                     f"{beats.lost_after_s:.0f} s (half distributed.heartbeat_timeout_s="
                     f"{timeout_s}): it died, or its machine did")

    beats.beat()
    thread = threading.Thread(target=watch, name="capibara-peers", daemon=True)
    thread.start()
    try:
        yield
    except Exception as err:
        if lost_peer(err):
            others = ", ".join(str(i) for i in range(n) if i != me)
            stop(f"{where}: a collective with process {others} failed: it died, or its "
                 f"machine did ({first_line(err)})")
        raise
    finally:
        done.set()
    beats.beat("done")  # a peer still at work does not take this one's end for a death
