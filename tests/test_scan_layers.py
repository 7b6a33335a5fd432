"""scan_layers: one nn.scan over blocks of layers computes what the unrolled layers compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.core import unfreeze
from flax.linen import partitioning as nn_partitioning

from capibara_exp.nets.decoder import Decoder, DecoderConfig
from capibara_exp.nets.moe import MoeConfig, MoeDecoder
from capibara_exp.runtime.contrib_moe import per_layer_metrics, unscan

CONFIG = DecoderConfig(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_layers=4,
                       mlp_dim=64)


def _tokens(batch=2, length=16):
    return jax.random.randint(jax.random.PRNGKey(3), (batch, length), 1, 64)


def stack_unrolled(params: dict, block: int) -> dict:
    """Unrolled params (layers_<i>/...) in the scanned layout (layers/layers_<j>/..., stacked
    over blocks): layer i = b * block + j."""
    flat = traverse_util.flatten_dict(unfreeze(params), sep="/")
    out, stacked = {}, {}
    for key, value in flat.items():
        head, _, rest = key.partition("/")
        if head.startswith("layers_"):
            i = int(head.removeprefix("layers_"))
            stacked.setdefault(f"layers/layers_{i % block}/{rest}", {})[i // block] = value
        else:
            out[key] = value
    for key, by_block in stacked.items():
        out[key] = jnp.stack([by_block[b] for b in sorted(by_block)])
    return traverse_util.unflatten_dict(out, sep="/")


@pytest.mark.parametrize("moe", [None, MoeConfig(num_experts=4, moe_layer_interval=2)])
def test_scanned_decoder_matches_unrolled(moe):
    make = (lambda c: Decoder(c)) if moe is None else (lambda c: MoeDecoder(c, moe_config=moe))
    unrolled, scanned = make(CONFIG), make(dataclasses.replace(CONFIG, scan_layers=True))
    tokens = _tokens()
    def init(module):
        return jax.jit(lambda rng: module.init({"params": rng}, tokens, tokens,
                                               enable_dropout=False))(jax.random.PRNGKey(0))

    def apply(module, params):
        return jax.jit(lambda p: module.apply({"params": p}, tokens, tokens, enable_dropout=False,
                                              mutable=["intermediates"]))(params)

    variables, scanned_vars = init(unrolled), init(scanned)
    params = stack_unrolled(variables["params"], 1 if moe is None else 2)
    # Same tree and shapes as the scanned module's own, with a leading axis of blocks.
    assert jax.tree.structure(params) == jax.tree.structure(unfreeze(scanned_vars["params"]))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape,
                                                           unfreeze(scanned_vars["params"]))
    axes = nn_partitioning.get_axis_names(scanned_vars["params_axes"])
    assert axes["layers"]["layers_0"]["self_attention"]["query"]["kernel"][0] == "layers"

    want, want_state = apply(unrolled, variables["params"])
    got, got_state = apply(scanned, params)
    assert not np.allclose(np.asarray(want), 0.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    if moe is not None:  # sown per layer: unrolled layers_1, layers_3 = scanned blocks 0, 1
        stacked = got_state["intermediates"]["layers"]["layers_1"]["mlp"]["auxiliary_loss"][0]
        assert stacked.shape == (2,)
        want_m = per_layer_metrics(want_state["intermediates"])
        got_m = per_layer_metrics(unscan(got_state["intermediates"], 2))
        assert sorted(want_m) == sorted(got_m)
        assert "experts/layers_3/router_confidence" in got_m
        for key, value in want_m.items():
            np.testing.assert_allclose(np.asarray(got_m[key]), np.asarray(value), rtol=2e-5,
                                       atol=1e-6, err_msg=key)


def test_layers_past_the_last_whole_block_stay_unrolled_and_compute_the_same():
    """Gemma 3's 26 layers repeat a block of 6 (five local, one global): four blocks
    scanned, layers 24 and 25 unrolled. The same with 5 layers in blocks of 3."""
    config = dataclasses.replace(CONFIG, num_layers=5, position_embedding="rope",
                                 sliding_window=3, sliding_window_pattern=3)
    unrolled, scanned = Decoder(config), Decoder(dataclasses.replace(config, scan_layers=True))
    tokens = _tokens()
    variables = jax.jit(lambda rng: unrolled.init({"params": rng}, tokens, tokens,
                                                  enable_dropout=False))(jax.random.PRNGKey(0))
    flat = traverse_util.flatten_dict(unfreeze(variables["params"]), sep="/")
    scanned_params = stack_unrolled({k: v for k, v in variables["params"].items()
                                     if k not in ("layers_3", "layers_4")}, 3)
    scanned_params = {**scanned_params, "layers_3": variables["params"]["layers_3"],
                      "layers_4": variables["params"]["layers_4"]}
    shapes = jax.eval_shape(lambda: scanned.init({"params": jax.random.PRNGKey(0)}, tokens,
                                                 tokens, enable_dropout=False))["params"]
    assert sorted(traverse_util.flatten_dict(unfreeze(shapes), sep="/")) == sorted(
        traverse_util.flatten_dict(scanned_params, sep="/"))
    assert "layers_4/self_attention/query/kernel" in flat
    want = unrolled.apply({"params": variables["params"]}, tokens, tokens, enable_dropout=False)
    got = scanned.apply({"params": scanned_params}, tokens, tokens, enable_dropout=False)
    assert not np.allclose(np.asarray(want), 0.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
