"""Callback events of the local engine's train loop, beyond T5X's actions.

T5X's actions run only after a train-eval pass (or a train report). A `Callback` is such
an action (bound the same way, in `train_script.train.actions`, so real T5X runs its
`run` too) that also hears the loop's events under the local engine:

  on_train_begin(step, model_dir)      after the restore, before the first step
  on_metrics(step, split, metrics)     every record written to metrics.jsonl
  on_checkpoint_saved(step, path)      a checkpoint committed, with its manifest
  on_preemption(step, path)            SIGTERM/SIGINT: the state saved at `path` (or None)
  on_train_end(step, model_dir)        the loop finished (total steps, or an action stopped it)
  on_merge(report)                     a consensus merge wrote its checkpoint and report

Events reach every callback once, whatever modes it is bound under, on process 0 only
(as actions). Under real T5X only `run` is called: a callback that logs falls back to
the metrics it is given there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from capibara_exp.runtime.trainer import BaseAction

EVENTS = ("train_begin", "metrics", "checkpoint_saved", "preemption", "train_end", "merge")


class Callback(BaseAction):
    """A T5X action that also hears the local engine's events (all no-ops here)."""

    events: Events | None = None  # set by the loop (bind_events): None under real T5X

    def bind_events(self, events: Events) -> None:
        self.events = events

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Any]) -> bool:
        return False

    def on_train_begin(self, step: int, model_dir: str) -> None:
        pass

    def on_metrics(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        pass

    def on_checkpoint_saved(self, step: int, path: str) -> None:
        pass

    def on_preemption(self, step: int, path: str | None) -> None:
        pass

    def on_train_end(self, step: int, model_dir: str) -> None:
        pass

    def on_merge(self, report: Mapping[str, Any]) -> None:
        pass


class Events:
    """The loop's events, sent to every bound action that has the matching `on_<event>`."""

    def __init__(self, actions: Mapping[str, Sequence[BaseAction]]):
        self.listeners: list[Any] = []
        for acts in actions.values():
            for action in acts:
                if all(action is not known for known in self.listeners):
                    self.listeners.append(action)
        for action in self.listeners:
            if hasattr(action, "bind_events"):
                action.bind_events(self)
        self._saved: set[int] = set()

    def emit(self, event: str, **payload: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r} (events: {', '.join(EVENTS)})")
        if jax.process_index() != 0:
            return
        for action in self.listeners:
            handler = getattr(action, f"on_{event}", None)
            if handler is not None:
                handler(**payload)

    def saved(self, saver: Any, wait: bool = False) -> None:
        """`checkpoint_saved` for each checkpoint the saver (None: none) newly committed
        (Orbax commits in the background: the loop reports them from the main thread);
        `wait`: until every save in flight has committed."""
        if saver is None:
            return
        if wait:
            saver.wait()
        for step, path in list(saver.committed):
            if step not in self._saved:
                self._saved.add(step)
                self.emit("checkpoint_saved", step=step, path=path)


class EventWriter:
    """A metrics writer that also sends each record as a `metrics` event."""

    def __init__(self, writer: Any, events: Events):
        self._writer, self._events = writer, events

    def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        self._writer.write(step, split, metrics)
        self._events.emit("metrics", step=int(step), split=split,
                          metrics={k: float(v) for k, v in metrics.items()})

    def text(self, *args: Any) -> None:
        self._writer.text(*args)

    def close(self) -> None:
        self._writer.close()
