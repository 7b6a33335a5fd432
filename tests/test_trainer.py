"""The trainer's step against a hand-written optax step, and microbatching against none."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio

from capibara_exp.nets import Decoder, DecoderConfig
from capibara_exp.runtime import models, optimizers, partitioning, utils
from capibara_exp.runtime.state import initial_state
from capibara_exp.runtime.trainer import Trainer

BATCH, LENGTH = 4, 16


def make_model() -> models.DecoderOnlyModel:
    # SGD, not Adam: Adam's first steps are sign(g) and turn float rounding in gradients
    # that are almost zero into large differences; SGD keeps differences at rounding level.
    net = Decoder(DecoderConfig(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16,
                                num_layers=2, mlp_dim=48))
    tx = optimizers.chain([optax.clip_by_global_norm(1e3),
                           optax.sgd(utils.create_learning_rate_scheduler(
                               factors="constant", base_learning_rate=1e-3))])
    return models.DecoderOnlyModel(net, seqio.ByteVocabulary(), tx, z_loss=1e-4)


def batch() -> dict:
    tokens = jax.random.randint(jax.random.PRNGKey(3), (BATCH, LENGTH), 1, 64)
    segments = jnp.concatenate(
        [jnp.ones((BATCH, 10), jnp.int32), 2 * jnp.ones((BATCH, 6), jnp.int32)], 1)
    positions = jnp.concatenate([jnp.arange(10), jnp.arange(6)])[None].repeat(BATCH, 0)
    return {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
            "decoder_segment_ids": segments, "decoder_positions": positions,
            "decoder_loss_weights": jnp.ones((BATCH, LENGTH), jnp.int32)}


def trainer_and_state(model, num_microbatches):
    state, axes = initial_state(model, jax.random.PRNGKey(0), BATCH, LENGTH)
    trainer = Trainer(model=model, train_state=state, partitioner=partitioning.PjitPartitioner(),
                      eval_names=[], summary_dir=None, train_state_axes=axes,
                      rng=jax.random.PRNGKey(1), num_microbatches=num_microbatches,
                      learning_rate_fn=utils.create_learning_rate_scheduler())
    return trainer, jax.device_put(state, trainer.state_shardings)


def test_train_step_equals_a_hand_written_optax_step() -> None:
    model = make_model()
    trainer, state = trainer_and_state(model, None)
    params, opt_state = jax.tree.map(np.asarray, (state.params, state.opt_state))
    tx = model.optimizer_def.optax_optimizer
    for _ in range(3):
        grads = jax.grad(lambda p: model.loss_fn(p, batch(), None)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        state, metrics = trainer.train_step(state, batch())
    assert int(state.step) == 3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 state.params, params)
    assert metrics["weight_sum"] == BATCH * LENGTH


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_microbatching_gives_the_full_batch_gradient_step(num_microbatches: int) -> None:
    model = make_model()
    full, state_full = trainer_and_state(model, None)
    micro, state_micro = trainer_and_state(model, num_microbatches)
    state_full, m_full = full.train_step(state_full, batch())
    state_micro, m_micro = micro.train_step(state_micro, batch())
    assert not np.allclose(jax.tree.leaves(state_full.params)[0],
                           jax.tree.leaves(trainer_and_state(model, None)[1].params)[0])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 state_full.params, state_micro.params)
    np.testing.assert_allclose(m_full["loss_sum"], m_micro["loss_sum"], rtol=1e-6)


def test_batch_not_divisible_by_microbatches_is_an_error() -> None:
    trainer, _ = trainer_and_state(make_model(), 3)
    want = r"batch size 4 does not divide by trainer.Trainer.num_microbatches=3"
    with pytest.raises(ValueError, match=want):
        trainer.check_batch_size(BATCH)
