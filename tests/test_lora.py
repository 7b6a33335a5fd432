"""LoRA: only adapters train and are saved, the base stays bit-identical, the merged export
is a normal checkpoint that computes what the adapted model computes."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util

import gin
from capibara_exp import gin_bridge
from capibara_exp.paths import GIN_DIR
from capibara_exp.runtime import checkpoints, gin_utils, lora, moe
from capibara_exp.runtime.state import initial_state
from tests.conftest import compose_config
from tests.test_features import make_model
from tests.test_train import TINY, leaves_equal, read_checkpoint, train
from tests.test_trainer import batch

COMMON = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2"]


@pytest.mark.slow
def test_lora_trains_only_adapters_and_merges_into_a_normal_checkpoint(tmp_path: Path,
                                                                       data_dir) -> None:
    base_dir, lora_dir, merged_dir = tmp_path / "base", tmp_path / "lora", tmp_path / "merged"
    train(base_dir, "trainer.train_steps=2", *COMMON)
    base_before = read_checkpoint(base_dir, 2)

    train(lora_dir, "trainer.train_steps=2", "lora=default", "lora.lora_rank=4",
          f"lora.lora_base_checkpoint={base_dir}/checkpoint_2", "schedule.base_learning_rate=0.05",
          *COMMON)
    model = gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    saved = read_checkpoint(lora_dir, 2)["target"]
    flat = traverse_util.flatten_dict(saved, sep="/")
    assert sorted(flat) == [f"layers_{i}/self_attention/{m}/lora_{ab}"
                            for i in (0, 1) for m in ("query", "value") for ab in "ab"]
    assert flat["layers_0/self_attention/query/lora_a"].shape == (32, 4)
    assert np.abs(flat["layers_0/self_attention/query/lora_b"]).max() > 0  # it trained

    assert leaves_equal(read_checkpoint(base_dir, 2), base_before)  # the base on disk
    assert leaves_equal(model.frozen_params, base_before["target"])  # the base in training

    out = lora.export_run(lora_dir, merged_dir)
    merged = read_checkpoint(merged_dir, 2)
    assert out == merged_dir / "checkpoint_2" and set(merged) == {"state", "target"}
    m_flat = traverse_util.flatten_dict(merged["target"], sep="/")
    b_flat = traverse_util.flatten_dict(base_before["target"], sep="/")
    changed = sorted(k for k in b_flat if not np.array_equal(m_flat[k], b_flat[k]))
    assert changed == [f"layers_{i}/self_attention/{m}/kernel" for i in (0, 1)
                       for m in ("query", "value")]
    q = "layers_0/self_attention/query"
    np.testing.assert_allclose(
        m_flat[f"{q}/kernel"],
        b_flat[f"{q}/kernel"] + model.scale * flat[f"{q}/lora_a"] @ flat[f"{q}/lora_b"],
        rtol=1e-6, atol=1e-7)

    example = {k: v % 260 for k, v in batch().items()}
    adapted = model.loss_fn(jax.tree.map(np.asarray, saved), example, None)[0]
    plain = model.base.loss_fn(merged["target"], example, None)[0]
    assert adapted != model.base.loss_fn(base_before["target"], example, None)[0]
    np.testing.assert_allclose(adapted, plain, rtol=2e-5)

    step, _ = train(merged_dir, "trainer.train_steps=3", "trainer.eval_period=1",
                    "checkpoint.checkpoint_period=1")  # a normal run resumes from it
    assert step == 3


def test_target_patterns_that_match_nothing_name_the_module_paths(tmp_path: Path) -> None:
    model = lora.LoraModel(base=make_model(), base_checkpoint=str(tmp_path),
                           target_modules=["attn.*"])
    params = {"layers_0": {"mlp": {"wo": {"kernel": np.zeros((4, 2))}}}}
    with pytest.raises(ValueError, match=r"match no 2-D kernel; module paths are: "
                                         r"\['layers_0/mlp/wo'\]"):
        model.targets(params)
    with pytest.raises(FileNotFoundError, match=r"base_checkpoint: no checkpoint in"):
        _ = model.frozen_params


@pytest.mark.slow
def test_lora_wraps_the_model_groups_model_a_moe_one_included(tmp_path: Path) -> None:
    # lora.gin wraps the model group's BASE_MODEL, so experiment=moe_e2b_tiny gets adapters
    # on its MoeDecoderOnlyModel. Two MoeTrainer steps from gin train only the adapters,
    # with the MoE losses in the objective; the base, read from a real checkpoint, stays
    # bit-identical.
    base_dir = tmp_path / "base"
    cfg = compose_config([f"model_dir={tmp_path / 'lora'}", "experiment=moe_e2b_tiny", *TINY,
                          "data=bytes_lm", "lora=default", f"lora.lora_base_checkpoint={base_dir}"])
    gin_utils.parse(tmp_path / "config.gin", gin_bridge.render(cfg, "local", GIN_DIR))
    get = lambda name: gin.query_parameter(name).scoped_configurable_fn  # noqa: E731
    model = get("train_script.train.model")()
    assert isinstance(model, lora.LoraModel) and isinstance(model.base, moe.MoeDecoderOnlyModel)
    init = jax.jit(model.base.get_initial_variables, static_argnums=(1, 2))
    base_params = init(jax.random.PRNGKey(0), 4, 16)["params"]
    mgr = checkpoints.manager(base_dir)  # T5X's layout: the params are the 'target'
    checkpoints.save(mgr, 1, {"state": {"step": np.int32(1)}, "target": base_params})
    mgr.close()

    state, axes = initial_state(model, jax.random.PRNGKey(1), 4, 16)
    partitioner = get("train_script.train.partitioner")()
    trainer = get("train_script.train.trainer_cls")(
        model=model, train_state=state, partitioner=partitioner, eval_names=[],
        summary_dir=None, train_state_axes=axes, rng=jax.random.PRNGKey(2))
    assert isinstance(trainer, moe.MoeTrainer)
    example = jax.device_put(batch(), partitioner.data_sharding())
    state = trainer.prepare_state(state)
    for _ in range(2):  # the warm-up's first rate is 0
        state, metrics = trainer.train_step(state, example)
    flat = traverse_util.flatten_dict(jax.device_get(state.params), sep="/")
    assert sorted(flat) == [f"layers_{i}/self_attention/{m}/lora_{ab}"
                            for i in (0, 1) for m in ("query", "value") for ab in "ab"]
    assert np.abs(flat["layers_1/self_attention/query/lora_b"]).max() > 0
    assert float(metrics[moe.MEAN + "experts/auxiliary_loss"]) > 0
    assert leaves_equal(model.frozen_params, base_params)
