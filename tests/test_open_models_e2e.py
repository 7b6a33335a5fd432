"""The open-model path of docs/models.md, end to end: a Llama-style model trained here is
exported to the Hugging Face format (transformers computes its logits), imported back, and
training continues from it under both engines with the loss where it left off; LoRA and
QLoRA fine-tune the import, two fine-tunes merge, and the merge exports and re-imports with
its shapes and dtypes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from capibara_exp.cli import convert as convert_cli
from capibara_exp.cli import merge as merge_cli
from capibara_exp.runtime import checkpoints
from tests import hf_reference
from tests.test_lora import EVAL_ONLY, eval_loss
from tests.test_train import train

pytest.importorskip("transformers", reason="the reference implementation: pip install "
                    "'capibara-exp[reference]' (the test extra has it)")
SMALL = ["data.batch_size=4", "data.task_feature_lengths={targets: 64}", "trainer.eval_steps=2",
         "data.packing=seqio",  # the batches T5X packs, so both engines evaluate alike
         "trainer.stats_period=1", "schedule.warmup_steps=1"]
STEPS = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2",
         "checkpoint.checkpoints_to_keep=null"]


def convert(*argv: str) -> dict:
    try:
        convert_cli.main(list(argv))
    except SystemExit as stop:
        raise AssertionError(f"capibara-exp-convert {argv} exited {stop.code}") from None
    return {}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, data_dir) -> dict:
    """llama3_tiny trained 6 steps, exported, and that export imported: the paths."""
    root = tmp_path_factory.mktemp("open")
    run = root / "pretrain"
    train(run, "model=llama3_tiny", *SMALL, *STEPS, "trainer.train_steps=6",
          "schedule.base_learning_rate=0.02")
    convert("export", f"checkpoint={run}", f"out={root / 'hf'}")  # the model: its config.gin
    convert("import", f"hf_dir={root / 'hf'}", f"out={root / 'imported'}", "name=mine")
    return {"root": root, "run": run, "hf": root / "hf", "imported": root / "imported",
            "model": ["model=mine", f"hydra.searchpath=[file://{root / 'imported' / 'conf'}]"],
            "initial": f"checkpoint.initial_checkpoint={root / 'imported' / 'checkpoint_0'}"}


@pytest.mark.slow
def test_the_export_computes_our_logits_in_transformers(pretrained: dict) -> None:
    from capibara_exp.convert import hf_export, hf_import
    from capibara_exp.convert.network import network

    keys = hf_export.model_of_gin(pretrained["run"] / "config.gin")
    ckpt = hf_export.locate(pretrained["run"])
    shapes = hf_import.param_shapes(keys)
    import jax
    from flax import traverse_util

    flat = checkpoints.restore_params(ckpt, {k: jax.ShapeDtypeStruct(v, np.float32)
                                             for k, v in shapes.items()})
    tokens = np.random.default_rng(3).integers(1, 260, (2, 16))
    ours = np.asarray(network(keys).apply(
        {"params": traverse_util.unflatten_dict(dict(flat), sep="/")}, tokens, tokens,
        enable_dropout=False))
    theirs, _ = hf_reference.reference_logits(pretrained["hf"], tokens)
    assert float(np.max(np.abs(ours - theirs))) <= 1e-4


@pytest.mark.slow
def test_training_continues_from_the_import_where_it_left_off(pretrained: dict,
                                                             tmp_path: Path) -> None:
    """The eval loss before the first step of a run started from the import is the
    pretraining run's last eval loss (same model, same validation batches); a run from
    scratch starts far above it."""
    left_off = eval_loss(pretrained["run"], 6)
    run = tmp_path / "continued"
    train(run, *pretrained["model"], pretrained["initial"], *SMALL, *STEPS,
          "trainer.train_steps=2", EVAL_ONLY)
    assert abs(eval_loss(run, 0) - left_off) < 1e-4
    scratch = tmp_path / "scratch"
    train(scratch, *pretrained["model"], *SMALL, *STEPS, "trainer.train_steps=2", EVAL_ONLY)
    assert eval_loss(scratch, 0) > left_off + 0.3
    assert eval_loss(run, 2) < eval_loss(scratch, 2)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("t5x") is None,
                    reason="engine=t5x needs T5X (.ci/run installs it from ../shared/third_party)")
def test_t5x_continues_from_the_import_too(pretrained: dict, tmp_path: Path) -> None:
    import subprocess
    import sys

    run = tmp_path / "t5x"
    cmd = [sys.executable, "-m", "capibara_exp.cli", "engine=t5x", f"model_dir={run}",
           f"--config-dir={pretrained['imported'] / 'conf'}", "model=mine",
           pretrained["initial"], *SMALL, *STEPS, "trainer.train_steps=2",
           f"data_dir={pretrained['root'].parent / 'data'}", EVAL_ONLY]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert abs(eval_loss(run, 0) - eval_loss(pretrained["run"], 6)) < 1e-3


@pytest.mark.slow
def test_lora_qlora_and_a_merge_of_fine_tunes_export_and_reimport(pretrained: dict,
                                                                 tmp_path: Path) -> None:
    base = pretrained["imported"] / "checkpoint_0"
    for name, extra in (("lora", []), ("qlora", ["lora.quantize_base=nf4",
                                                 "lora.quantize_block_size=16"])):
        train(tmp_path / name, *pretrained["model"], "lora=all", f"lora.base_checkpoint={base}",
              *extra, *SMALL, *STEPS, "trainer.train_steps=2")
        assert checkpoints.steps(tmp_path / name) == [2]
    for seed in (1, 2):
        train(tmp_path / f"ft{seed}", *pretrained["model"], pretrained["initial"], *SMALL,
              *STEPS, "trainer.train_steps=2", f"random_seed={seed}")
    merged = tmp_path / "merged"
    try:
        merge_cli.main(["method=uniform", f"runs=[{tmp_path / 'ft1'},{tmp_path / 'ft2'}]",
                        f"out={merged}"])
    except SystemExit as stop:
        assert not stop.code, f"capibara-exp-merge exited {stop.code}"
    conf = str(pretrained["imported"] / "conf")
    convert("export", f"checkpoint={merged}", f"out={tmp_path / 'hf'}", "model=mine",
            f"config_dir={conf}")  # a merge dir has no config of its own
    convert("import", f"hf_dir={tmp_path / 'hf'}", f"out={tmp_path / 'again'}", "name=again")
    first = checkpoints.tree_metadata(checkpoints.step_dir(merged, 2))
    again = checkpoints.tree_metadata(tmp_path / "again" / "checkpoint_0")
    params = {p: (tuple(m.shape), str(m.dtype)) for p, m in first.items() if p[0] == "target"}
    assert params == {p: (tuple(m.shape), str(m.dtype)) for p, m in again.items()
                      if p[0] == "target"}
    record = json.loads((tmp_path / "again" / "import.json").read_text())
    assert record["architecture"] == "LlamaForCausalLM"
