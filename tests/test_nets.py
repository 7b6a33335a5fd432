"""The decoder network: shapes, causality, packing, prefix-LM, logical axes, remat, config."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning

from capibara_exp.nets import Decoder, DecoderConfig

SIZES = dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_layers=2, mlp_dim=48)
POSITION_EMBEDDINGS = ["relative", "rope"]


# Every forward pass uses one [2, 12] shape and runs eagerly: jax caches each compiled op by
# shape, so the tests share compilations instead of compiling a whole graph per test.
SHAPE = (2, 12)


def init_shapes(net: Decoder) -> dict:
    """The variables `net.init` would make, as shapes and dtypes, without compiling."""
    tokens = jnp.ones(SHAPE, jnp.int32)
    init = functools.partial(net.init, enable_dropout=False)
    return jax.eval_shape(init, jax.random.PRNGKey(0), tokens, tokens)


@functools.cache
def base_params() -> dict:
    net = Decoder(DecoderConfig(**SIZES))
    tokens = jnp.ones(SHAPE, jnp.int32)
    init = jax.jit(functools.partial(net.init, enable_dropout=False))
    return init(jax.random.PRNGKey(0), tokens, tokens)["params"]


@functools.cache
def make(position_embedding: str = "relative", **kw) -> tuple[Decoder, dict]:
    """A network and parameters: the base network's, minus what this variant lacks
    (relpos_bias with rope, logits_dense when tied), so one initialisation serves all."""
    net = Decoder(DecoderConfig(**SIZES, position_embedding=position_embedding, **kw))
    shapes = init_shapes(net)["params"]
    params = {name: base_params()[name] for name in shapes}
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, shapes)
    return net, {"params": params}


def logits(net: Decoder, variables: dict, tokens: jnp.ndarray, **features) -> np.ndarray:
    """Teacher-forced logits, with the inputs doubling as targets (zeros are padding)."""
    return np.asarray(
        net.apply({"params": variables["params"]}, tokens, tokens, enable_dropout=False, **features)
    )


def tokens_of(seed: int, shape=SHAPE) -> jnp.ndarray:
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, SIZES["vocab_size"])


def flat_axes(variables: dict) -> dict:
    specs = nn_partitioning.get_axis_names(variables["params_axes"])
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return {
        jax.tree_util.keystr(p): tuple(s)
        for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    }


@pytest.mark.parametrize("position_embedding", POSITION_EMBEDDINGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_shape_and_dtype(position_embedding: str, dtype: str) -> None:
    net, variables = make(position_embedding, dtype=dtype)
    out = logits(net, variables, tokens_of(0))
    assert out.shape == (2, 12, SIZES["vocab_size"]) and out.dtype == np.float32
    assert np.isfinite(out).all()
    param_dtypes = {p.dtype for p in jax.tree.leaves(init_shapes(net)["params"])}
    assert param_dtypes == {jnp.dtype(jnp.float32)}  # compute dtype never reaches parameters


def test_tied_embeddings_have_no_output_projection() -> None:
    net, variables = make(logits_via_embedding=True)
    assert "logits_dense" not in variables["params"]
    assert logits(net, variables, tokens_of(0)).shape == (2, 12, SIZES["vocab_size"])


@pytest.mark.parametrize("position_embedding", POSITION_EMBEDDINGS)
def test_future_tokens_do_not_change_past_logits(position_embedding: str) -> None:
    net, variables = make(position_embedding)
    a = tokens_of(1)
    b = a.at[:, 7:].set(tokens_of(2)[:, 7:])
    la, lb = logits(net, variables, a), logits(net, variables, b)
    np.testing.assert_array_equal(la[:, :7], lb[:, :7])
    assert not np.allclose(la[:, 7:], lb[:, 7:])


@pytest.mark.parametrize("position_embedding", POSITION_EMBEDDINGS)
def test_packed_row_equals_each_sequence_alone(position_embedding: str) -> None:
    net, variables = make(position_embedding)
    tokens = tokens_of(3)
    first, second = tokens[0, :5], tokens[1, :6]

    def pad(*parts: jnp.ndarray) -> jnp.ndarray:
        return jnp.concatenate([*parts, jnp.zeros(SHAPE[1] - sum(map(len, parts)), jnp.int32)])

    # Each alone, unpacked and zero-padded; then packed both ways round, with one pad token.
    alone = logits(net, variables, jnp.stack([pad(first), pad(second)]))
    packed = jnp.stack([pad(first, second), pad(second, first)])
    segments = jnp.array([[1] * 5 + [2] * 6 + [0], [1] * 6 + [2] * 5 + [0]])
    positions = jnp.array([[*range(5), *range(6), 0], [*range(6), *range(5), 0]])
    out = logits(net, variables, packed, decoder_segment_ids=segments, decoder_positions=positions)
    close = functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-5)
    close(out[0, :5], alone[0, :5])
    close(out[0, 5:11], alone[1, :6])
    close(out[1, :6], alone[1, :6])
    close(out[1, 6:11], alone[0, :5])


@pytest.mark.parametrize("position_embedding", POSITION_EMBEDDINGS)
def test_prefix_attends_bidirectionally_and_the_rest_causally(position_embedding: str) -> None:
    net, variables = make(position_embedding)
    a = tokens_of(5)
    prefix = jnp.array([[1] * 4 + [0] * 8] * 2)
    changed_prefix = a.at[:, 3].set(a[:, 3] % 60 + 2)
    changed_suffix = a.at[:, 9].set(a[:, 9] % 60 + 2)
    run = lambda t: logits(net, variables, t, decoder_causal_attention=prefix)  # noqa: E731
    base = run(a)
    assert not np.allclose(base[:, 0], run(changed_prefix)[:, 0])  # token 0 sees prefix token 3
    np.testing.assert_array_equal(base[:, :9], run(changed_suffix)[:, :9])
    # Without the prefix flag the same change is invisible to token 0: the test is not vacuous.
    np.testing.assert_array_equal(
        logits(net, variables, a)[:, 0], logits(net, variables, changed_prefix)[:, 0]
    )


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_every_param_has_logical_axes_of_its_rank(remat_policy: str) -> None:
    variables = init_shapes(Decoder(DecoderConfig(**SIZES, remat_policy=remat_policy)))
    axes = flat_axes(variables)
    params = {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    }
    assert axes.keys() == params.keys()
    for path, leaf in params.items():
        assert len(axes[path]) == leaf.ndim, path
    # T5X's decoder-only names and axes, so its partitioning rules and tooling apply.
    assert axes["['token_embedder']['embedding']"] == ("vocab", "embed")
    assert axes["['relpos_bias']['rel_embedding']"] == ("heads", "relpos_buckets")
    assert axes["['layers_1']['self_attention']['query']['kernel']"] == ("embed", "joined_kv")
    assert axes["['layers_1']['self_attention']['out']['kernel']"] == ("joined_kv", "embed")
    assert axes["['layers_0']['mlp']['wi_0']['kernel']"] == ("embed", "mlp")
    assert axes["['layers_0']['mlp']['wo']['kernel']"] == ("mlp", "embed")
    assert axes["['layers_0']['pre_mlp_layer_norm']['scale']"] == ("embed",)
    assert axes["['logits_dense']['kernel']"] == ("embed", "vocab")
    assert len(params) == 1 + 1 + 2 * 9 + 1 + 1


@functools.cache
def loss_and_grads(remat_policy: str) -> tuple[jnp.ndarray, dict]:
    net = Decoder(DecoderConfig(**SIZES, remat_policy=remat_policy))
    tokens = tokens_of(6)

    def loss(params: dict) -> jnp.ndarray:
        return jnp.mean(net.apply({"params": params}, tokens, tokens, enable_dropout=False) ** 2)

    return jax.jit(jax.value_and_grad(loss))(base_params())  # eager backward is slower


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_matches_no_remat_in_value_and_gradient(policy: str) -> None:
    v0, g0 = loss_and_grads("none")
    v1, g1 = loss_and_grads(policy)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_dropout_changes_outputs_only_when_enabled() -> None:
    net, variables = make(dropout_rate=0.5)
    tokens = tokens_of(7)
    params = {"params": variables["params"]}

    @jax.jit  # the training path compiles once; eager dropout compiles op by op
    def train(seed: int) -> jnp.ndarray:
        return net.apply(params, tokens, tokens, rngs={"dropout": jax.random.PRNGKey(seed)})

    assert not np.allclose(train(0), train(1))

    def evaluate(seed: int) -> jnp.ndarray:
        rngs = {"dropout": jax.random.PRNGKey(seed)}
        return net.apply(params, tokens, tokens, enable_dropout=False, rngs=rngs)

    np.testing.assert_array_equal(evaluate(0), evaluate(1))
    np.testing.assert_array_equal(evaluate(0), logits(*make(), tokens))  # same params, no dropout


def test_config_accepts_lists_from_gin_and_yaml() -> None:
    config = DecoderConfig(**SIZES, mlp_activations=["gelu", "linear"])
    assert config.mlp_activations == ("gelu", "linear")
    hash(config)  # Flax module attributes must be hashable


@pytest.mark.parametrize(
    "field, value",
    [
        ("position_embedding", "alibi"),
        ("dtype", "float16"),
        ("remat_policy", "some"),
        ("mlp_activations", ["tanh"]),
        ("emb_dim", 0),
        ("dropout_rate", 1.0),
        ("relative_attention_max_distance", 8),
    ],
)
def test_config_errors_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"DecoderConfig.{field}"):
        DecoderConfig(**{**SIZES, field: value})


def _qkv_and_masks(seed: int, packed: bool):
    """Random q, k, v [B, L, H, K] and target tokens with padding (and two packed segments)."""
    from capibara_exp.nets.decoder import decoder_mask

    batch, length, heads, head_dim = 2, 256, 2, 64
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
               for _ in range(3))
    tokens = rng.integers(1, 50, (batch, length))
    tokens[0, 200:] = 0  # padding
    segments = None
    if packed:
        segments = np.ones((batch, length), np.int32)
        segments[1, 100:] = 2
        segments[1, 250:] = 0
        tokens[1, 250:] = 0
        segments = jnp.asarray(segments)
    tokens = jnp.asarray(tokens)
    return (q, k, v), tokens, segments, decoder_mask(tokens, segments)


def assert_splash_matches_dot(seed: int, packed: bool, **splash_options) -> None:
    """The splash kernel (with `splash_options`) against dot attention on every real
    position of _qkv_and_masks(seed, packed): outputs, and the gradients of q, k and v."""
    from capibara_exp.nets import attention, splash

    qkv, tokens, segments, mask = _qkv_and_masks(seed, packed)
    real = np.asarray(tokens > 0)[:, :, None, None]
    kernel_segments = splash.segments_for_splash(tokens, segments)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v), 0.0) ** 2)

    def dot(q, k, v):
        return attention.dot_attention(q, k, v, mask)

    def kernel(q, k, v):
        return splash.splash_attention(q, k, v, kernel_segments, interpret=True,
                                       **splash_options)

    want, got = jax.jit(dot)(*qkv), jax.jit(kernel)(*qkv)
    assert float(jnp.max(jnp.abs(jnp.where(real, want - got, 0.0)))) < 1e-5
    grads_want = jax.jit(jax.grad(loss(dot), argnums=(0, 1, 2)))(*qkv)
    grads_got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(*qkv)
    for name, a, b in zip("qkv", grads_want, grads_got, strict=True):
        scale = float(jnp.max(jnp.abs(a)))
        assert scale > 1.0 and float(jnp.max(jnp.abs(a - b))) < 1e-5 * scale, name


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_splash_kernel_matches_dot_attention_in_value_and_gradient(packed: bool) -> None:
    """JAX's Pallas splash kernel (run by the Pallas interpreter on CPU) against the dot
    reference on every real position: outputs and the gradients of q, k and v."""
    assert_splash_matches_dot(int(packed), packed)


@pytest.mark.slow
def test_splash_kernel_with_grouped_heads_a_window_and_a_soft_cap_matches_dot() -> None:
    """Grouped-query attention through the kernel's multi-query form (4 query heads over 2
    key/value heads), a local window of 40 keys and Gemma 2's soft-cap, against dot."""
    from capibara_exp.nets import attention, splash

    (q, _, _), tokens, _, mask = _qkv_and_masks(2, False)
    q = jnp.concatenate([q, q[..., ::-1]], axis=2)  # 4 query heads
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.normal(size=(2, 256, 2, 64)), jnp.float32) for _ in range(2))
    positions = jnp.arange(256)[None]
    local = mask & attention.window_mask(positions, positions, 40)
    real = np.asarray(tokens > 0)[:, :, None, None]
    want = jax.jit(lambda q, k, v: attention.dot_attention(q, k, v, local, cap=2.0))(q, k, v)
    got = jax.jit(lambda q, k, v: splash.splash_attention(
        q, k, v, splash.segments_for_splash(tokens), cap=2.0, window=40, interpret=True))(q, k, v)
    assert float(jnp.max(jnp.abs(jnp.where(real, want, 0.0)))) > 0.1
    assert float(jnp.max(jnp.abs(jnp.where(real, want - got, 0.0)))) < 1e-5


@pytest.mark.slow
def test_splash_config_runs_dot_attention_off_tpu_and_names_what_it_cannot_do() -> None:
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 128), 1, SIZES["vocab_size"])
    configs = {a: DecoderConfig(**SIZES, position_embedding="rope", attention=a)
               for a in ("dot", "splash")}
    variables = jax.jit(functools.partial(Decoder(configs["dot"]).init, enable_dropout=False))(
        jax.random.PRNGKey(0), tokens, tokens)
    out = {a: np.asarray(jax.jit(functools.partial(Decoder(c).apply, enable_dropout=False))(
        variables, tokens, tokens)) for a, c in configs.items()}
    np.testing.assert_array_equal(out["splash"], out["dot"])  # lowered for CPU: dot itself
    with pytest.raises(ValueError, match="needs position_embedding='rope'"):
        DecoderConfig(**SIZES, attention="splash")
    with pytest.raises(ValueError, match="attention probabilities; set dropout_rate=0"):
        DecoderConfig(**SIZES, position_embedding="rope", attention="splash", dropout_rate=0.1)
    with pytest.raises(ValueError, match="DecoderConfig.attention"):
        DecoderConfig(**SIZES, attention="flash")
    splash = Decoder(configs["splash"])
    with pytest.raises(ValueError, match="sequence length 12 must be a multiple of 128"):
        splash.init(jax.random.PRNGKey(0), tokens_of(0), tokens_of(0), enable_dropout=False)
    with pytest.raises(ValueError, match="prefix-LM mask\\) needs DecoderConfig.attention='dot'"):
        splash.apply(variables, tokens, tokens, decoder_causal_attention=tokens > 0,
                     enable_dropout=False)
