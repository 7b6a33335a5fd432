"""Progress for the phases of a run that last more than a few seconds (building data, XLA
compiles, restoring a checkpoint), so a long wait is never silent.

A phase says nothing if it ends within SHOW_AFTER_S; past that it prints what it is doing,
then the elapsed time (rewritten in place every second on a terminal, a new line every
NOTE_EVERY_S otherwise), and how long it took when it ends.

`starting(prog)` is a console script's first line, printed once its command line checks and
before anything heavy is imported; the phase lines after it carry the same program name.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from capibara_exp.base.environment import copy_to_run_log

SHOW_AFTER_S = 3.0
NOTE_EVERY_S = 15.0
PROG = "capibara-exp"


def starting(prog: str, detail: str = "") -> None:
    """`PROG: starting DETAIL ...`, on stderr at once; later phase lines name `prog` too."""
    global PROG
    PROG = prog
    line = f"{prog}: starting{detail} ..."
    print(line, file=sys.stderr, flush=True)
    copy_to_run_log(line)


@contextlib.contextmanager
def importing(what: str = "TensorFlow, JAX and SeqIO") -> Iterator[None]:
    """The import of heavy libraries, as a phase (seconds on a loaded machine)."""
    with phase(f"importing {what}"):
        yield


class _Ticker:
    def __init__(self, what: str, stream: TextIO):
        self.what, self.stream = what, stream
        self.t0 = time.perf_counter()
        self.done = threading.Event()
        self.shown = False
        self.detail = ""  # how far it got ("120/480 files", set by the caller), shown with the time
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.thread = threading.Thread(target=self._run, name="capibara-phase", daemon=True)
        self.thread.start()

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _write(self, text: str, end: str) -> None:
        try:
            self.stream.write(text + end)
            self.stream.flush()
        except (ValueError, OSError):  # the stream was closed under the run (a caller's
            self.done.set()  # capture ended, a pipe's reader left): progress is not worth a crash

    def _run(self) -> None:
        if self.done.wait(SHOW_AFTER_S):
            return
        line = f"{PROG}: {self.what} ..."
        with _SCREEN:  # a phase inside another (a compile while the state is built): its own
            self.shown = True  # line below the outer one's, which waits until it ends
            self._write(("\n" if self.tty and _ON_SCREEN else "") + line,
                        "" if self.tty else "\n")
            _ON_SCREEN.append(self)
        copy_to_run_log(line)
        while not self.done.wait(1.0 if self.tty else NOTE_EVERY_S):
            detail = f" {self.detail}," if self.detail else ""
            with _SCREEN:
                if not self.tty:
                    self._write(f"{line}{detail} {self._elapsed():.0f} s", "\n")
                elif _ON_SCREEN[-1] is self:
                    self._write(f"\r\033[K{line}{detail} {self._elapsed():.0f} s", "")

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        if self.shown:
            took = f"{PROG}: {self.what}: {self._elapsed():.1f} s"
            with _SCREEN:
                top = _ON_SCREEN[-1] is self
                _ON_SCREEN.remove(self)
                self._write(("\r\033[K" if top else "\n") * self.tty + took, "\n")
            copy_to_run_log(took)


_SCREEN = threading.Lock()
_ON_SCREEN: list[_Ticker] = []  # the phases shown and not ended, innermost last


@contextlib.contextmanager
def phase(what: str, stream: TextIO | None = None) -> Iterator[_Ticker]:
    """Show `what` while the block runs, if it runs longer than SHOW_AFTER_S; the block may
    set the yielded ticker's `detail` to say how far it got."""
    ticker = _Ticker(what, stream or sys.stderr)
    try:
        yield ticker
    finally:
        ticker.stop()


_compiles: dict[str, _Ticker] = {}
_listening = False


def show_compiles(stream: TextIO | None = None) -> None:
    """Show XLA compiles as phases, from JAX's compile events: lowering ends, the backend
    compile starts; the backend compile's duration event ends it."""
    global _listening
    if _listening:
        return
    from jax import monitoring

    def on_event(event: str, duration: float, **kwargs: object) -> None:
        del duration
        name = str(kwargs.get("fun_name", "a program"))
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            _compiles[name] = _Ticker(f"compiling {name}", stream or sys.stderr)
        elif event == "/jax/core/compile/backend_compile_duration" and name in _compiles:
            _compiles.pop(name).stop()

    monitoring.register_event_duration_secs_listener(on_event)
    _listening = True
