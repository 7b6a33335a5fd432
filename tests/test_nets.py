"""The decoder network: shapes, causality, packing, prefix-LM, logical axes, remat."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning

from capibara_exp.nets import Decoder, DecoderConfig

SIZES = dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_layers=2, mlp_dim=48)


def make(position_embedding: str = "relative", **kw) -> tuple[Decoder, dict]:
    net = Decoder(DecoderConfig(**SIZES, position_embedding=position_embedding, **kw))
    tokens = jnp.ones((2, 12), jnp.int32)
    variables = net.init({"params": jax.random.PRNGKey(0)}, tokens, tokens, enable_dropout=False)
    return net, variables


def logits(net, variables, tokens, **features):
    return net.apply({"params": variables["params"]}, tokens, tokens, enable_dropout=False,
                     **features)


def tokens_of(seed: int, shape=(2, 12)) -> jnp.ndarray:
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, SIZES["vocab_size"])


@pytest.mark.parametrize("position_embedding", ["relative", "rope"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_shape_and_dtype(position_embedding: str, dtype: str) -> None:
    net, variables = make(position_embedding, dtype=dtype)
    out = logits(net, variables, tokens_of(0))
    assert out.shape == (2, 12, SIZES["vocab_size"]) and out.dtype == jnp.float32
    assert jax.tree.leaves(jax.tree.map(lambda p: p.dtype == jnp.float32, variables["params"]))


@pytest.mark.parametrize("position_embedding", ["relative", "rope"])
def test_future_tokens_do_not_change_past_logits(position_embedding: str) -> None:
    net, variables = make(position_embedding)
    a = tokens_of(1)
    b = a.at[:, 7:].set(tokens_of(2)[:, 7:])
    la, lb = logits(net, variables, a), logits(net, variables, b)
    np.testing.assert_array_equal(la[:, :7], lb[:, :7])
    assert not np.allclose(la[:, 7:], lb[:, 7:])


@pytest.mark.parametrize("position_embedding", ["relative", "rope"])
def test_packed_row_equals_each_sequence_alone(position_embedding: str) -> None:
    net, variables = make(position_embedding)
    first, second = tokens_of(3, (1, 5)), tokens_of(4, (1, 7))
    packed = jnp.concatenate([first, second], axis=1)
    segments = jnp.array([[1] * 5 + [2] * 7])
    positions = jnp.array([list(range(5)) + list(range(7))])
    out = logits(net, variables, packed, decoder_segment_ids=segments, decoder_positions=positions)
    np.testing.assert_allclose(out[:, :5], logits(net, variables, first), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[:, 5:], logits(net, variables, second), atol=1e-5, rtol=1e-5)


def test_prefix_attends_bidirectionally_and_the_rest_causally() -> None:
    net, variables = make()
    a = tokens_of(5)
    prefix = jnp.array([[1] * 4 + [0] * 8] * 2)
    changed_prefix = a.at[:, 3].set((a[:, 3] % 60) + 2)
    changed_suffix = a.at[:, 9].set((a[:, 9] % 60) + 2)
    base = logits(net, variables, a, decoder_causal_attention=prefix)
    after_prefix = logits(net, variables, changed_prefix, decoder_causal_attention=prefix)
    after_suffix = logits(net, variables, changed_suffix, decoder_causal_attention=prefix)
    assert not np.allclose(base[:, 0], after_prefix[:, 0])  # token 0 sees prefix token 3
    np.testing.assert_array_equal(base[:, :9], after_suffix[:, :9])


def test_every_param_has_logical_axes_of_its_rank() -> None:
    _, variables = make()
    axes = nn_partitioning.get_axis_names(variables["params_axes"])
    params, specs = variables["params"], axes
    flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_a = dict(jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0])
    assert len(flat_p) == len(flat_a)
    for path, leaf in flat_p:
        assert len(flat_a[path]) == leaf.ndim, path
    embed_path = next(p for p, _ in flat_p if "token_embedder" in str(p))
    assert tuple(flat_a[embed_path]) == ("vocab", "embed")


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_matches_no_remat_in_value_and_gradient(policy: str) -> None:
    base, variables = make()
    remat, _ = make(remat_policy=policy)
    tokens = tokens_of(6)

    def loss(net, params):
        return jnp.mean(net.apply({"params": params}, tokens, tokens, enable_dropout=False) ** 2)

    v0, g0 = jax.value_and_grad(lambda p: loss(base, p))(variables["params"])
    v1, g1 = jax.value_and_grad(lambda p: loss(remat, p))(variables["params"])
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_dropout_changes_outputs_only_when_enabled() -> None:
    net, variables = make(dropout_rate=0.5)
    tokens = tokens_of(7)
    run = lambda on, seed: net.apply({"params": variables["params"]}, tokens, tokens,  # noqa: E731
                                     enable_dropout=on, rngs={"dropout": jax.random.PRNGKey(seed)})
    np.testing.assert_array_equal(run(False, 0), run(False, 1))
    assert not np.allclose(run(True, 0), run(True, 1))


def test_decode_is_a_clear_error() -> None:
    net, variables = make()
    with pytest.raises(NotImplementedError, match="autoregressive decoding"):
        net.apply({"params": variables["params"]}, tokens_of(0), tokens_of(0), decode=True)


@pytest.mark.parametrize("field, value", [("position_embedding", "alibi"), ("dtype", "float16"),
                                          ("remat_policy", "some"), ("mlp_activations", ["tanh"]),
                                          ("emb_dim", 0)])
def test_config_errors_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"DecoderConfig.{field}"):
        DecoderConfig(**{**SIZES, field: value})
