"""Training features: remat, bf16 compute, schedules, EMA, the skip-step NaN guard, early
stopping, MFU and the plot command. Tiny real steps and runs, no mocks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import GIN_DIR
from capibara_exp.cli import plot as plot_cli
from capibara_exp.composing import gin_bridge
from capibara_exp.nets import Decoder, DecoderConfig
from capibara_exp.runtime import checkpoints, models, optimizers, partitioning, utils
from capibara_exp.runtime.state import initial_state
from capibara_exp.runtime.train_script import TrainingDiverged
from capibara_exp.runtime.trainer import EarlyStoppingAction, Trainer
from tests.conftest import compose_config
from tests.test_train import leaves_equal, read_checkpoint, train
from tests.test_trainer import BATCH, LENGTH, batch

SIZES = dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_layers=2, mlp_dim=48)


def make_model(lr: float = 1e-2, **net) -> models.DecoderOnlyModel:
    tx = optimizers.chain([optax.clip_by_global_norm(1.0), optax.sgd(lr)])
    return models.DecoderOnlyModel(Decoder(DecoderConfig(**SIZES, **net)), seqio.ByteVocabulary(),
                                   tx, z_loss=1e-4)


def make_trainer(model, **kwargs):
    state, axes = initial_state(model, jax.random.PRNGKey(0), BATCH, LENGTH)
    trainer = Trainer(model=model, train_state=state, partitioner=partitioning.PjitPartitioner(),
                      eval_names=[], summary_dir=None, train_state_axes=axes,
                      rng=jax.random.PRNGKey(1), num_microbatches=None,
                      learning_rate_fn=utils.create_learning_rate_scheduler(), **kwargs)
    return trainer, trainer.prepare_state(state)


# ---- remat and bf16 -----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_policy_gives_the_same_loss_and_gradients(policy: str) -> None:
    plain, remat = make_model(), make_model(remat_policy=policy)
    params = initial_state(plain, jax.random.PRNGKey(0), BATCH, LENGTH)[0].params

    def loss_and_grads(model):
        return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch(), None)[0]))(params)

    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(plain), loss_and_grads(remat)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads_a, grads_b)
    # ...and the policy really rematerialises: the differentiated program holds a remat.
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: remat.loss_fn(p, batch(), None)[0]))(params))
    assert "remat" in jaxpr or "checkpoint" in jaxpr
    assert "remat" not in str(jax.make_jaxpr(
        jax.grad(lambda p: plain.loss_fn(p, batch(), None)[0]))(params))


def test_bf16_computes_in_bf16_and_keeps_f32_parameters() -> None:
    model = make_model(dtype="bfloat16")
    trainer, state = make_trainer(model)
    jaxpr = str(jax.make_jaxpr(lambda p: model.loss_fn(p, batch(), None)[0])(state.params))
    dots = [line for line in jaxpr.splitlines() if "dot_general" in line]
    assert dots and sum("bf16" in line for line in dots) >= len(dots) // 2
    state, metrics = trainer.train_step(state, batch())
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(metrics["loss_sum"])
    f32_loss = make_model().loss_fn(state.params, batch(), None)[0]
    bf16_loss = model.loss_fn(state.params, batch(), None)[0]
    assert bf16_loss != f32_loss and abs(bf16_loss / f32_loss - 1) < 0.02


def test_global_norm_clipping_bounds_the_update_and_the_raw_norm_is_reported() -> None:
    tx = optimizers.chain([optax.clip_by_global_norm(1e-3), optax.sgd(1.0)])
    model = models.DecoderOnlyModel(Decoder(DecoderConfig(**SIZES)), seqio.ByteVocabulary(), tx)
    trainer, state = make_trainer(model)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = trainer.train_step(state, batch())
    step_norm = optax.tree.norm(jax.tree.map(lambda a, b: np.asarray(a) - b, state.params, before))
    assert float(metrics["grad_norm"]) > 1e-2  # the gradient's norm before clipping
    np.testing.assert_allclose(step_norm, 1e-3, rtol=1e-4)


# ---- schedules ----------------------------------------------------------------------------

def test_warmup_cosine_schedule_matches_the_hand_formula() -> None:
    cfg = compose_config(["schedule=warmup_cosine", "schedule.warmup_steps=10",
                          "schedule.steps_per_cycle=40", "schedule.base_learning_rate=0.5"])
    s = cfg.schedule
    fn = utils.create_learning_rate_scheduler(
        factors=s.lr_factors, base_learning_rate=s.base_learning_rate,
        warmup_steps=s.warmup_steps, steps_per_cycle=s.steps_per_cycle)

    def hand(step: int) -> float:
        warm = min(1.0, step / 10)
        cosine = 0.5 * (1 + math.cos(math.pi * (max(0.0, (step - 10) / 40) % 1.0)))
        return max(0.5 * warm * cosine, 1e-8)

    steps = [0, 1, 5, 10, 11, 20, 30, 49, 50, 55]
    np.testing.assert_allclose([float(fn(jnp.asarray(t))) for t in steps],
                               [hand(t) for t in steps],
                               rtol=1e-6, atol=0.5 * 0.5 * np.finfo(np.float32).eps)
    # (atol: near the bottom of the cycle 1 + cos(x) cancels in float32, at lr 0.5)
    assert float(fn(jnp.asarray(10))) == pytest.approx(0.5)
    assert float(fn(jnp.asarray(30))) == pytest.approx(0.25, rel=1e-6)  # half-way down


# ---- EMA ------------------------------------------------------------------------------------

def test_ema_follows_the_params_and_evaluation_uses_it() -> None:
    model = make_model(lr=0.5)
    trainer, state = make_trainer(model, ema_decay=0.5)
    expected = jax.tree.map(np.asarray, state.params)
    for _ in range(3):
        state, _ = trainer.train_step(state, batch())
        expected = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * np.asarray(p), expected, state.params)
    assert not leaves_equal(state.ema_params, state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 state.ema_params, expected)
    got = trainer.eval_step(state, batch())["loss_sum"]
    np.testing.assert_allclose(got, model.loss_fn(state.ema_params, batch(), None)[1]["loss_sum"],
                               rtol=1e-6)
    assert not np.isclose(got, model.loss_fn(state.params, batch(), None)[1]["loss_sum"])


@pytest.mark.slow
def test_ema_is_checkpointed_and_resume_is_exact(tmp_path: Path, data_dir) -> None:
    common = ["ema=default", "ema.ema_decay=0.9", "trainer.eval_period=2",
              "checkpoint.checkpoint_period=2", "checkpoint.checkpoints_to_keep=null"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(straight, "trainer.train_steps=4", *common)
    train(stopped, "trainer.train_steps=2", *common)
    final = read_checkpoint(straight, 4)
    assert set(final) == {"state", "target", "ema_target"}
    assert not leaves_equal(final["ema_target"], final["target"])
    assert not leaves_equal(read_checkpoint(stopped, 2)["ema_target"], final["ema_target"])
    train(stopped, "trainer.train_steps=4", *common)
    assert leaves_equal(read_checkpoint(stopped, 4), final)


# ---- NaN guard: skip policy ---------------------------------------------------------------

def test_skip_policy_keeps_the_state_on_a_nonfinite_step() -> None:
    trainer, state = make_trainer(make_model(), skip_nonfinite_updates=True)
    weights = batch()["decoder_loss_weights"].astype(jnp.float32).at[0, 0].set(jnp.inf)
    bad = dict(batch(), decoder_loss_weights=weights)  # one corrupt batch: an Inf loss
    before = jax.tree.map(np.asarray, state.params)
    state, m_bad = trainer.train_step(state, bad)
    assert int(state.step) == 1 and float(m_bad["skipped_steps"]) == 1.0
    assert leaves_equal(state.params, before) and float(m_bad["loss_sum"]) == 0.0
    state, m_good = trainer.train_step(state, batch())
    assert float(m_good["skipped_steps"]) == 0.0 and not leaves_equal(state.params, before)


@pytest.mark.slow
def test_skip_policy_stops_after_consecutive_skips(tmp_path: Path, data_dir) -> None:
    common = ["trainer.eval_period=2", "checkpoint.checkpoint_period=2"]
    train(tmp_path, "trainer.train_steps=2", *common)
    good = read_checkpoint(tmp_path, 2)
    with pytest.raises(TrainingDiverged, match=r"NaN/Inf for 2 steps in a row \(trainer.Trainer."
                                               r"max_consecutive_skips=2\)"):
        train(tmp_path, "trainer.train_steps=8", "schedule.base_learning_rate=1e30",
              "schedule.lr_factors=constant", "optimizer.grad_clip_norm=1e30",
              "nan_guard=skip", "nan_guard.max_consecutive_skips=2", *common)
    # Skipped steps leave the weights as they were, so every checkpoint written is finite.
    assert leaves_equal(read_checkpoint(tmp_path, 2), good)
    for step in checkpoints.steps(tmp_path):
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(read_checkpoint(tmp_path, step)))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records)


# ---- early stopping -------------------------------------------------------------------------

def test_early_stopping_matches_t5x_rules() -> None:
    action = EarlyStoppingAction(("task", "loss"), mode="min", patience=3, atol=0.1)

    def feed(values):
        return [action.run(None, {"task": {"loss": v}}) for v in values]

    # 3.0 -> 2.0 improves; 2.0 -> 1.95 is within atol (no improvement), then 1.95 -> 1.96.
    assert feed([3.0, 2.0, 1.95, 1.96]) == [False, False, False, True]
    assert EarlyStoppingAction(("t", "acc"), "max", patience=2).run(None, {}) is False
    grow = EarlyStoppingAction(("t", "acc"), "max", patience=2)
    assert [grow.run(None, {"t": {"acc": v}}) for v in (0.1, 0.2, 0.3, 0.3)] == [
        False, False, False, True]
    with pytest.raises(ValueError, match=r"no such train-eval metric"):
        grow.run(None, {"t": {"loss": 1.0}})
    with pytest.raises(ValueError, match=r"mode must be 'min' or 'max', got 'low'"):
        EarlyStoppingAction(("t", "acc"), "low")


@pytest.mark.slow
def test_early_stopping_from_conf_stops_the_run(tmp_path: Path, data_dir) -> None:
    step, _ = train(tmp_path, "trainer.train_steps=20", "trainer.eval_period=1",
                    "checkpoint.checkpoint_period=1", "checkpoint.checkpoints_to_keep=1",
                    "early_stopping=default", "early_stopping.early_stopping_patience=2",
                    "early_stopping.early_stopping_atol=100.0")
    assert step == 2  # the second evaluation cannot beat the first by 100 nats
    assert checkpoints.steps(tmp_path) == [2]


# ---- gin: the local engine's own features --------------------------------------------------

def test_local_only_features_are_refused_for_t5x_and_t5x_features_render_for_both() -> None:
    cfg = compose_config(["ema=default"])
    with pytest.raises(ConfigError, match=r"ema: the local engine's own feature"):
        gin_bridge.render(cfg, "t5x", GIN_DIR)
    assert "train_script.train.ema_decay = %EMA_DECAY" in gin_bridge.render(cfg, "local", GIN_DIR)
    cfg = compose_config(["early_stopping=default"])
    local, t5x = (gin_bridge.render(cfg, e, GIN_DIR) for e in ("local", "t5x"))
    assert gin_bridge.body_of(local) == gin_bridge.body_of(t5x)
    assert "@trainer.EarlyStoppingAction()" in local


# ---- MFU and the plot command ---------------------------------------------------------------

@pytest.mark.slow
def test_mfu_is_reported_and_plot_renders_the_run(tmp_path: Path, data_dir, capsys) -> None:
    train(tmp_path, "trainer.train_steps=3", "trainer.eval_period=3",
          "checkpoint.checkpoint_period=3")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mfu = [r["mfu"] for r in records if r["split"] == "train"]
    assert mfu and all(0 < m < 1 for m in mfu)
    assert json.loads((tmp_path / "peak_flops.json").read_text())["matmul_peak_flops"] > 1e8
    out = tmp_path.parent / f"{tmp_path.name}_curves.png"  # beside the run: it is only read
    plot_cli.main([str(tmp_path), "--out", str(out)])  # returns (exit 0), prints the path once
    assert capsys.readouterr().out == f"{out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exit_info:
        plot_cli.main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    assert "nowhere: no such file or directory" in capsys.readouterr().err
