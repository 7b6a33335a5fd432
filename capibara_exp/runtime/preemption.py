"""Preemption: SIGTERM (what a preempted TPU VM gets) or SIGINT asks training to stop after
the step in progress, save that step and exit with errors.PREEMPTED_EXIT_CODE.

One process: the handlers set a flag that the loop reads after every step. Several
processes: JAX's preemption service (started by jax.distributed.initialize) catches SIGTERM
on any host and agrees on a step every host reaches; `reached_preemption_sync_point` is
asked at every step, so all hosts save the same one. SIGINT there is passed on as SIGTERM
to this process, so Ctrl-C on one host stops all of them at one step too. A second signal
while the first is being handled gets the default behaviour (the process ends at once).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import jax

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Use as a context manager around the train loop; `requested(step)` after each step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only: nothing to catch
        for sig in SIGNALS:
            if self._multi and sig == signal.SIGTERM:
                continue  # JAX's preemption notifier owns SIGTERM
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
        if self._multi:  # the preemption service tells every host
            self.signal_name = name
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signal_name = name

    def requested(self, step: int) -> bool:
        """Whether to save `step` and stop (every host answers alike for the same step)."""
        if not self._multi:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        try:
            reached = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
            return False
        if reached and self.signal_name is None:
            self.signal_name = "a preemption notice (SIGTERM on a host)"
        return reached
