"""engine=t5x's data wait: the time T5X's train loop spends in next() on its train iterator.

T5X measures no input wait. Its train script takes the train data from the callable bound
to `train_script.train.get_dataset_fn` (t5x.utils.get_dataset by default); capibara-exp
binds that to `timed_get_dataset` (launch/t5x_main.py adds BINDINGS unless the gin files
or flags bind get_dataset_fn themselves), which calls T5X's own function and wraps what it
returns in a DatasetIterator that times get_next. T5X then treats it as any iterator a
get_dataset_fn may return (utils.prepare_train_iter: sharding, peeking; its dataset
checkpoints go through save/restore to the tf.data iterator inside, as before).

Each get_next appends `<wall time> <seconds waited so far>` to the file named by
CAPIBARA_DATA_WAIT_FILE; the parent (t5x_engine._Progress) turns the wait within each of
T5X's summary windows into the progress line's `data wait` share, as the local engine's
StepWindow does. Without that variable the data is returned unwrapped.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Any

WAIT_FILE_ENV = "CAPIBARA_DATA_WAIT_FILE"
# The binding, as T5X's --gin_bindings lines: config.gin registers dynamically (as T5X's own
# gin files do), and a bindings string knows only the imports it makes itself.
BINDINGS = ("from __gin__ import dynamic_registration", "import __main__ as train_script",
            "from capibara_exp.launch import t5x_data",
            "train_script.train.get_dataset_fn = @t5x_data.timed_get_dataset")


def timed_get_dataset(*args: Any, get_dataset_fn: Any = None, **kwargs: Any) -> Any:
    """T5X's get_dataset (or `get_dataset_fn`), its train iterator timed."""
    from t5x import utils

    data = (get_dataset_fn or utils.get_dataset)(*args, **kwargs)
    path = os.environ.get(WAIT_FILE_ENV)
    return _timed(data, path) if path else data


def _timed(data: Any, path: str) -> Any:
    import clu.data
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):  # as utils.prepare_train_iter would wrap it
        data = clu.data.dataset_iterator.TfDatasetIterator(data, checkpoint=True)
    if type(data).__module__.startswith("airio") or \
            not isinstance(data, clu.data.dataset_iterator.DatasetIterator):
        return data  # T5X takes AirIO's iterators as they are: left untimed
    return _wrapper_class()(data, path)


def _wrapper_class() -> type:
    import clu.data

    class TimedIterator(clu.data.dataset_iterator.DatasetIterator):
        """`inner`, with the seconds spent in get_next summed and appended to `path`."""

        def __init__(self, inner: Any, path: str):
            self._inner = inner
            self._waited = 0.0
            self._out = open(path, "a", buffering=1)  # noqa: SIM115 (the iterator's life)

        def get_next(self) -> Any:
            t0 = time.perf_counter()
            batch = self._inner.get_next()
            self._waited += time.perf_counter() - t0
            self._out.write(f"{time.time():.3f} {self._waited:.6f}\n")
            return batch

        def __next__(self) -> Any:
            return self.get_next()

        def reset(self) -> None:
            self._inner.reset()

        @property
        def element_spec(self) -> Any:
            return self._inner.element_spec

        def save(self, filename: Any) -> Any:
            return self._inner.save(filename)

        def restore(self, filename: Any) -> Any:
            return self._inner.restore(filename)

        def load(self, filename: Any) -> Any:
            return self._inner.load(filename)

    return TimedIterator


class WaitLog:
    """The (wall time, seconds waited so far) records of a wait file, read as they grow
    (each call to `update` reads only the lines written since the last)."""

    def __init__(self, path: str | None):
        self.path, self.offset = path, 0
        self.times: list[float] = []
        self.waited: list[float] = []

    def update(self) -> WaitLog:
        if not self.path:
            return self
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self
        done = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self.offset += done
        for line in chunk[:done].decode().splitlines():
            parts = line.split()
            if len(parts) == 2:
                self.times.append(float(parts[0]))
                self.waited.append(float(parts[1]))
        return self

    def _waited_at(self, at: float) -> float:
        i = bisect.bisect_right(self.times, at)
        return self.waited[i - 1] if i else 0.0

    def share(self, end: float, seconds: float) -> float | None:
        """The share of the window of `seconds` ending at wall time `end` spent waiting;
        None without records or window."""
        if seconds <= 0 or not self.times:
            return None
        waited = self._waited_at(end) - self._waited_at(end - seconds)
        return min(max(waited / seconds, 0.0), 1.0)
