"""launch/t5x_data.py on real tf.data and CLU iterators (no T5X needed): the timed train
iterator yields what it wraps, logs one record per batch, and passes T5X's dataset
checkpoints through; the wait log reads only complete lines, as they come."""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf
from clu.data import dataset_iterator as clu_iter

from capibara_exp.launch import t5x_data


def test_the_timed_iterator_yields_logs_and_checkpoints_as_the_one_it_wraps(
        tmp_path: Path) -> None:
    log = tmp_path / "waits"

    def data():  # batches as T5X's feature converters give them: flat dicts
        return tf.data.Dataset.range(10).map(lambda x: {"decoder_target_tokens": x})

    timed = t5x_data._timed(data(), str(log))
    assert isinstance(timed, clu_iter.DatasetIterator)
    # what T5X would have wrapped the data in itself (utils.prepare_train_iter)
    assert timed.element_spec == clu_iter.TfDatasetIterator(data(), checkpoint=True).element_spec

    def take(n: int) -> list[int]:
        return [int(next(timed)["decoder_target_tokens"]) for _ in range(n)]

    first = take(3)
    timed.save(tmp_path / "ckpt")  # T5X's dataset checkpoint, through the wrapper
    after = take(2)
    timed.restore(tmp_path / "ckpt")
    assert first == [0, 1, 2] and after == [3, 4] and take(1) == [3]
    waits = t5x_data.WaitLog(str(log)).update()
    assert len(waits.times) == 6  # one record a batch
    assert waits.waited == sorted(waits.waited) and waits.times == sorted(waits.times)


def test_the_wait_log_reads_complete_lines_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "waits"
    path.write_text("100.0 0.5\n101.0 0.75\n102.")
    waits = t5x_data.WaitLog(str(path)).update()
    assert waits.times == [100.0, 101.0]  # the line being written waits
    with path.open("a") as f:
        f.write("0 1.5\n")
    waits.update()
    assert waits.times == [100.0, 101.0, 102.0] and waits.waited == [0.5, 0.75, 1.5]
    # the window (100, 102]: 1.0 s of its 2 s waited
    assert waits.share(102.0, 2.0) == pytest.approx(0.5)
    assert waits.share(102.0, 0.0) is None and t5x_data.WaitLog(None).update().share(1, 1) is None

