"""LoRA and QLoRA through config.gin: only the adapters train and are checkpointed (with a
pointer to the base and its checksum), a resume is bitwise, the merged export evaluates as
the adapted model did, and every mistake is an error naming its key."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import qwix
from flax import traverse_util

from capibara_exp.base.errors import ConfigError
from capibara_exp.cli import lora as lora_cli
from capibara_exp.runtime import checkpoints, integrity
from tests.test_train import leaves_equal, read_checkpoint, train

COMMON = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2",
          "checkpoint.checkpoints_to_keep=null", "schedule.base_learning_rate=0.05"]
EVAL_ONLY = 'gin_bindings=["train_script.train.run_eval_before_training = True"]'
BLOCK = 16  # quantization block: divides the tiny model's kernel inputs (32 and 64)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory, data_dir) -> Path:
    """A pretrained tiny dense model: two steps, checkpoint_2."""
    path = tmp_path_factory.mktemp("lora") / "base"
    train(path, "trainer.train_steps=2", *COMMON)
    return path


def flat(tree) -> dict:
    return traverse_util.flatten_dict(tree, sep="/")


def eval_loss(model_dir: Path, step: int) -> float:
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "train_eval" and r["step"] == step][-1]["loss"]


def export(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """capibara-exp-lora in this process: (exit status, its one line of output)."""
    try:
        lora_cli.main(list(args))
        code = 0
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, (out.out or out.err).strip().splitlines()[-1]


@pytest.mark.slow
def test_qlora_trains_only_adapters_and_its_export_evaluates_like_it(
        tmp_path: Path, base_run: Path, capsys: pytest.CaptureFixture) -> None:
    base_before = read_checkpoint(base_run, 2)
    run, out = tmp_path / "qlora", tmp_path / "merged"
    train(run, "trainer.train_steps=2", "lora=all", "lora.rank=4", "lora.quantize_base=nf4",
          f"lora.quantize_block_size={BLOCK}", f"lora.base_checkpoint={base_run}", *COMMON)

    tree = read_checkpoint(run, 2)
    adapters = flat(tree["target"])
    kernels = [f"layers_{i}/{m}/kernel" for i in (0, 1) for m in (
        "self_attention/query", "self_attention/key", "self_attention/value",
        "self_attention/out", "mlp/wi_0", "mlp/wi_1", "mlp/wo")]
    assert sorted(adapters) == sorted(f"{k}_lora_{ab}" for k in kernels for ab in "ab")
    q = "layers_0/self_attention/query/kernel"
    mlp = "layers_0/mlp/wo/kernel"  # [64, 32]: A is [rank, in], B [rank, out]
    assert adapters[mlp + "_lora_a"].shape == (4, 64) and adapters[mlp + "_lora_b"].shape == (4, 32)
    assert np.abs(adapters[q + "_lora_b"]).max() > 0  # trained (B starts at zero)
    # The optimizer state is the adapters' only: every array in it has an adapter's shape.
    shapes = {v.shape for v in adapters.values()}
    assert all(np.shape(v) in shapes | {()} for v in flat(tree["state"]["param_states"]).values())
    pointer = json.loads((run / "checkpoint_2" / "lora_base.json").read_text())
    manifest = json.loads((base_run / "checkpoint_2" / integrity.MANIFEST).read_text())
    assert pointer["base_checkpoint"] == str(base_run / "checkpoint_2")
    assert pointer["manifest_sha256"] == hashlib.sha256(
        json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
    assert integrity.verify_checkpoint(run / "checkpoint_2") == []  # the pointer is covered
    assert "lora_base.json" in json.loads((run / "checkpoint_2" / integrity.MANIFEST
                                           ).read_text())["files"]
    assert leaves_equal(read_checkpoint(base_run, 2), base_before)  # the base stays as it was

    code, printed = export(capsys, "export", f"run_dir={run}", f"out={out}")
    assert (code, printed) == (0, str(out / "checkpoint_2"))
    merged, base_params = flat(read_checkpoint(out, 2)["target"]), flat(base_before["target"])
    assert sorted(merged) == sorted(base_params)
    for name in ("token_embedder/embedding", "logits_dense/kernel", "decoder_norm/scale"):
        assert np.array_equal(merged[name], base_params[name])  # not quantized, not adapted
    # nf4 with one scale per 16 inputs of each output channel, dequantized, plus the update
    # alpha / rank * A^T B (conf/lora: alpha 16): computed here with qwix's own functions.
    quantized = qwix.quantize(base_params[q], "nf4", channelwise_axes=[1], tiled_axes={0: BLOCK})
    want = np.asarray(qwix.dequantize(quantized)) + 4.0 * (
        adapters[q + "_lora_a"].T @ adapters[q + "_lora_b"])
    np.testing.assert_allclose(merged[q], want, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(merged[q], base_params[q])

    # The export is a normal checkpoint: the base experiment evaluates it (T5X's way: total
    # steps = its step, eval before training) and gets the adapted model's eval loss.
    step, _ = train(out, "trainer.train_steps=2", EVAL_ONLY, *COMMON)
    assert step == 2 and checkpoints.steps(out) == [2]
    assert eval_loss(out, 2) == pytest.approx(eval_loss(run, 2), rel=1e-5)
    assert eval_loss(run, 2) != pytest.approx(eval_loss(base_run, 2), rel=1e-3)  # it learned

    assert export(capsys, "export", f"run_dir={run}", f"out={out}")[0] == 2  # no overwrite
    code, line = export(capsys, "export", f"run_dir={base_run}", f"out={tmp_path / 'x'}")
    assert code == 2 and "not a LoRA model" in line


@pytest.mark.slow
def test_lora_resume_is_bitwise_and_refuses_another_base(tmp_path: Path, base_run: Path) -> None:
    lora = ["lora=attention", "lora.dropout=0.2", f"lora.base_checkpoint={base_run}", *COMMON]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(straight, "trainer.train_steps=4", *lora)
    train(stopped, "trainer.train_steps=2", *lora)
    at_2, final = read_checkpoint(stopped, 2), read_checkpoint(straight, 4)
    assert not leaves_equal(at_2["target"], final["target"])  # resuming has work to do
    assert leaves_equal(at_2, read_checkpoint(straight, 2))
    step, _ = train(stopped, "trainer.train_steps=4", *lora)  # the same command, longer
    assert step == 4 and leaves_equal(read_checkpoint(stopped, 4), final)
    with pytest.raises(ConfigError, match=r"checkpoint_4 was trained on .*quantize_base="):
        train(stopped, "trainer.train_steps=6", "lora.quantize_base=int8",
              "lora.quantize_block_size=null", *lora)


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert export(capsys, "--help")[0] == 0
    for args, message in [((), "no command"), (("merge",), "unknown command 'merge'"),
                          (("export", "run_dir=a"), "missing out=..."),
                          (("export", "run_dir=a", "out=b", "steps=3"), "unknown key 'steps'"),
                          (("export", "run_dir=a", "out=b", "step=x"), "expected a checkpoint"),
                          (("export", f"run_dir={tmp_path}", "out=b"), "no checkpoint_<step>")]:
        code, line = export(capsys, *args)
        assert code == 2 and message in line and line.startswith("capibara-exp-lora: "), line


def test_lora_mistakes_are_errors_naming_the_key(tmp_path: Path) -> None:
    import jax
    from jax.sharding import PartitionSpec

    from capibara_exp.nets import Decoder, DecoderConfig
    from capibara_exp.runtime import models, partitioning
    from capibara_exp.runtime.lora import LoraModel
    from tests.test_features import SIZES, make_model

    def lora(**kw):
        return LoraModel(make_model(), str(tmp_path / "base"), **{
            "target_axes": [["embed", "joined_kv"]], **kw})

    for kw, message in [({"rank": 0}, r"rank must be >= 1"),
                        ({"quantize_base": "fp4"}, r"quantize_base='fp4' is not one of"),
                        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)")]:
        with pytest.raises(ConfigError, match=message):
            lora(**kw)
    listing = (r"layers_0/mlp/wi_0 \(embed, mlp\);.*"
               r"layers_1/self_attention/value \(embed, joined_kv\)")
    for kw, message in [
            ({"target_axes": [["embed", "jointkv"]]}, r"\['jointkv'\] are not logical axis"),
            ({"target_axes": [["expert", "embed", "expert_mlp"]]}, r"match no projection"),
            ({"target_modules": ["attn.*"]}, r"'attn\.\*' matches no projection path"),
            ({"quantize_base": "nf4", "quantize_block_size": 24},
             r"quantize_block_size=24 does not divide the input size 32 of layers_0/")]:
        with pytest.raises(ConfigError, match=message) as err:
            _ = lora(**kw).layout
        assert "quantize_block_size" in kw or re.search(listing, str(err.value)), err.value
    # Only the listed kernels take adapters; the base must exist and fit the model.
    model = lora(target_modules=[r"layers_\d+/self_attention/(query|value)"], target_axes=[])
    assert model.layout.targets == tuple(f"layers_{i}/self_attention/{m}" for i in (0, 1)
                                         for m in ("query", "value"))
    frozen = model.frozen_inputs()
    assert frozen.axes["layers_0/mlp/wo/kernel"] == PartitionSpec("mlp", "embed")
    shardings = partitioning.PjitPartitioner().shardings(frozen.axes)
    with pytest.raises(ConfigError, match=r"base_checkpoint=.*base: no checkpoint_<step>/state"):
        frozen.load(shardings)
    other = models.DecoderOnlyModel(Decoder(DecoderConfig(**{**SIZES, "mlp_dim": 32})), None, None)
    params = other.get_initial_variables(jax.random.PRNGKey(0), 2, 8)["params"]
    mgr = checkpoints.manager(tmp_path / "base")
    checkpoints.save(mgr, 3, {"state": {"step": np.int32(3)}, "target": params})
    mgr.close()
    with pytest.raises(ConfigError, match=r"does not fit the model \(6 of \d+ parameters differ\); "
                                          r"first: layers_0/mlp/wi_0/kernel: checkpoint "
                                          r"\(32, 32\), model \(32, 48\)"):
        frozen.load(shardings)


def test_lora_checkpoints_are_not_merged_but_their_exports_are(tmp_path: Path) -> None:
    """Averaging adapter factors A and B is not averaging their updates: a merge of LoRA
    checkpoints is refused, at compose time (consensus=...) and by the merge's reader."""
    from capibara_exp.cli import checks, flags
    from capibara_exp.composing.resolvers import register_resolvers
    from capibara_exp.consensus import store
    from capibara_exp.runtime.lora import base

    register_resolvers()
    line = flags.parse(["lora=attention", "lora.base_checkpoint=x", "consensus=last_k",
                        f"model_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="adapter factors, which do not merge"):
        checks.compose_checked(line, "config")
    step = tmp_path / "run" / "checkpoint_4"
    (step / "state").mkdir(parents=True)
    store.candidate_from_path(step)  # a whole model's checkpoint is a candidate
    (step / base.POINTER).write_text("{}")
    with pytest.raises(ValueError, match="export it with `capibara-exp-lora export`"):
        store.candidate_from_path(step)
