"""engine=t5x against real T5X: the same config.gin trains there, and checkpoints cross over.

T5X is not on PyPI, so CI cannot install it; these tests run wherever `t5x` imports (a
TPU VM, or a machine where it was installed from its repository).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capibara_exp.runtime import checkpoints

pytestmark = pytest.mark.skipif(importlib.util.find_spec("t5x") is None,
                                reason="T5X is not installed (not on PyPI; install from its repo)")

TINY = ["debug=fast", "model.emb_dim=32", "model.mlp_dim=64", "data.batch_size=4"]


def capibara(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", *TINY, *args], cwd=cwd,
                         capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_t5x_trains_the_gin_and_checkpoints_cross_between_engines(tmp_path: Path, data_dir) -> None:
    model_dir = tmp_path / "model"
    common = [f"model_dir={model_dir}", f"data_dir={data_dir}"]
    t5x = ["engine=t5x", f"engine.python={sys.executable}"]
    capibara(*t5x, *common, cwd=tmp_path)
    assert checkpoints.steps(model_dir)[-2:] == [2, 4]  # T5X also writes checkpoint_0
    out = capibara("engine=local", "trainer.train_steps=6", *common, cwd=tmp_path)
    assert f"restored {model_dir}/checkpoint_4" in out.stderr
    capibara(*t5x, "trainer.train_steps=8", *common, cwd=tmp_path)
    assert checkpoints.steps(model_dir)[-1] == 8
