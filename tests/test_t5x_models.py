"""engine=t5x's model classes (generation/t5x_models.py, t5x_moe_models.py): T5X's own,
predict_batch drawing the decode_fn's samples per example. Against T5X itself: the same
decodes as T5X's predict_batch_with_aux asked for them, and T5X's predict_batch exactly when
the decode_fn names no sample count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
from t5x import decoding as t5x_decoding
from t5x import models as t5x_models_ref
from t5x.contrib.moe import models as t5x_moe_ref

from capibara_exp.generation import infer_sampling, t5x_models, t5x_moe_models
from tests.test_decoding import tiny

PROMPTS = ((5, 6, 7), (9, 10, 11, 12, 13))
LENGTH = 12


def batch() -> dict[str, jnp.ndarray]:
    """seqio.DecoderFeatureConverter's layout of prompts with room to generate: BOS 0, the
    prompt, zeros; causal attention over BOS and the prompt."""
    tokens = np.zeros((len(PROMPTS), LENGTH), np.int32)
    causal = np.zeros((len(PROMPTS), LENGTH), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, 1:len(p) + 1] = p
        causal[i, :len(p) + 1] = 1
    return {"decoder_input_tokens": jnp.asarray(tokens),
            "decoder_causal_attention": jnp.asarray(causal),
            "decoder_target_tokens": jnp.asarray(np.roll(tokens, -1, axis=1))}


CLASSES = [("dense_tiny", t5x_models.DecoderOnlyModel, t5x_models_ref.DecoderOnlyModel),
           ("moe_tiny", t5x_moe_models.MoeDecoderOnlyModel, t5x_moe_ref.MoeDecoderOnlyModel)]


@pytest.mark.parametrize("entry, ours, theirs", CLASSES)
def test_predict_batch_draws_the_decode_fns_samples_as_t5x_does(entry, ours, theirs) -> None:
    _, net, params = tiny(entry)
    vocab = seqio.ByteVocabulary()
    sampling = infer_sampling.InferSampling(num_samples=3, temperature=1.0)
    rng = jax.random.PRNGKey(3)
    got = ours(net, vocab, optimizer_def=None, decode_fn=sampling).predict_batch(
        params, batch(), rng=rng)
    want, _ = theirs(net, vocab, optimizer_def=None, decode_fn=sampling).predict_batch_with_aux(
        params, batch(), rng=rng, num_decodes=3, return_all_decodes=True)
    assert got.shape == (len(PROMPTS), 3, LENGTH)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(len({tuple(s) for s in np.asarray(row)}) > 1 for row in got)  # sampled


@pytest.mark.parametrize("entry, ours, theirs", CLASSES)
def test_a_decode_fn_without_a_sample_count_decodes_as_t5x(entry, ours, theirs) -> None:
    _, net, params = tiny(entry)
    vocab = seqio.ByteVocabulary()
    rng = jax.random.PRNGKey(3)
    for decode_fn in (t5x_decoding.temperature_sample, infer_sampling.InferSampling()):
        got = ours(net, vocab, optimizer_def=None, decode_fn=decode_fn).predict_batch(
            params, batch(), rng=rng)
        want = theirs(net, vocab, optimizer_def=None, decode_fn=decode_fn).predict_batch(
            params, batch(), rng=rng)
        assert got.shape == (len(PROMPTS), LENGTH)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_other_name_is_t5xs_own() -> None:
    assert t5x_models.EncoderDecoderModel is t5x_models_ref.EncoderDecoderModel
    assert t5x_moe_models.MoeEncoderDecoderModel is t5x_moe_ref.MoeEncoderDecoderModel
    assert issubclass(t5x_models.DecoderOnlyModel, t5x_models_ref.DecoderOnlyModel)
    assert issubclass(t5x_moe_models.MoeDecoderOnlyModel, t5x_moe_ref.MoeDecoderOnlyModel)
