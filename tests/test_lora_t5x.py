"""A LoRA run's merged export under real T5X: T5X restores it and its train-eval loss is the
adapted model's (engine=local) on the same batches.

T5X is not on PyPI; this runs wherever `t5x` imports (see /work/shared/third_party or a TPU
VM). Both engines read seqio's packing (data.packing=seqio), so their eval batches match.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_lora import COMMON, EVAL_ONLY, eval_loss, export
from tests.test_train import TINY, train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("t5x") is None,
                                reason="T5X is not installed (not on PyPI; install from its repo)")


def t5x_eval_loss(model_dir: Path) -> float:
    """The loss per non-padding target token T5X wrote for its train-eval pass."""
    import tensorflow as tf

    events = sorted((model_dir / "train_eval").rglob("events.out.tfevents.*"))
    for path in events:
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "loss_per_nonpadding_target_token":
                    return float(tf.make_ndarray(value.tensor))
    raise AssertionError(f"no train-eval loss in {events}")


@pytest.mark.slow
def test_t5x_evaluates_the_merged_export_as_the_adapted_model(
        tmp_path: Path, data_dir, capsys: pytest.CaptureFixture) -> None:
    seqio_packing = [*COMMON, "data.packing=seqio"]
    base, run, out = tmp_path / "base", tmp_path / "lora", tmp_path / "merged"
    train(base, "trainer.train_steps=2", *seqio_packing)
    train(run, "trainer.train_steps=2", "lora=mlp", "lora.quantize_base=int8",
          "lora.quantize_block_size=32", f"lora.base_checkpoint={base}", *seqio_packing)
    assert export(capsys, "export", f"run_dir={run}", f"out={out}")[0] == 0
    t5x = ["engine=t5x", f"engine.python={sys.executable}"]
    done = subprocess.run(
        [sys.executable, "-m", "capibara_exp.cli", *TINY, "trainer.train_steps=2", *seqio_packing,
         f"model_dir={out}", f"data_dir={data_dir}", *t5x, EVAL_ONLY, "verbose=true"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    # T5X only evaluated the export (its log says so: verbose=true lets absl's INFO through)
    assert "no training will be done" in done.stderr
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_2"]
    got, want = t5x_eval_loss(out), eval_loss(run, 2)
    assert np.isfinite(got) and got == pytest.approx(want, rel=1e-4)
    assert want != pytest.approx(eval_loss(base, 2), rel=1e-3)  # the adapters changed it
