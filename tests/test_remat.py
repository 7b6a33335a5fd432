"""Remat policies by name and by tensor (nets/remat.py): what each saves for the backward
pass, as JAX itself lists it (jax.ad_checkpoint.print_saved_residuals), the same loss and
gradients as no remat, offloaded tensors in host memory, and per-tensor lists checked
when the config is composed and when the network is built."""

from __future__ import annotations

import re

import pytest

from capibara_exp.base import model_facts

NAMED = re.compile(r"named '(\w+)'")


def _net(policy: str, **kw):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from capibara_exp.nets import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, num_layers=2,
                        mlp_dim=64, remat_policy=policy, **kw)
    net = Decoder(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 16)), jnp.int32)
    params = net.init(jax.random.PRNGKey(0), tokens, tokens, enable_dropout=False)["params"]

    def loss(p):
        logits = net.apply({"params": p}, tokens, tokens, enable_dropout=False)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return loss, params


def saved(policy: str, capsys, **kw) -> list[str]:
    """print_saved_residuals' lines for the loss of a 2-layer decoder under a policy."""
    from jax.ad_checkpoint import print_saved_residuals

    loss, params = _net(policy, **kw)
    capsys.readouterr()
    print_saved_residuals(loss, params)
    return capsys.readouterr().out.splitlines()


def names(lines: list[str], where: str = "") -> set[str]:
    return {m.group(1) for line in lines if where in line for m in [NAMED.search(line)] if m}


@pytest.mark.parametrize("policy, want", [
    ("save_qkv_proj", {"query_proj", "key_proj", "value_proj"}),
    ("save_dot_except_mlp", {"query_proj", "key_proj", "value_proj", "out_proj"}),
    # the MLP's output feeds only the residual add, whose gradient does not need it
    ("save_dot_except_mlpwi", {"query_proj", "key_proj", "value_proj", "out_proj"}),
    ("full", set()),
])
def test_named_policies_save_their_tensors(policy, want, capsys):
    assert names(saved(policy, capsys)) == want


def test_offload_moves_the_layer_inputs_to_host_memory(capsys):
    """`offload` (default: the layer input) keeps one host copy per layer instead of the
    device copy `full` keeps; `custom` keeps its remat_save tensors in HBM as well."""
    host = [line for line in saved("offload", capsys) if "<host>[2,16,32]" in line]
    assert len(host) == 2  # one [batch, length, embed] input per layer
    full = [line for line in saved("full", capsys) if "<host>" in line]
    assert full == []
    custom = saved("custom", capsys, remat_save=("query_proj",),
                   remat_offload=("decoder_layer_input", "mlpwi"))
    assert names(custom) == {"query_proj"}
    assert sum("<host>[2,16,32]" in line for line in custom) == 2


@pytest.mark.parametrize("policy", model_facts.REMAT_POLICIES)
def test_every_policy_gives_the_loss_and_gradients_of_no_remat(policy):
    import jax
    import numpy as np

    kw = ({"remat_save": ("out_proj",), "remat_offload": ("query_proj", "mlpwi")}
          if policy == "custom" else {})
    loss, params = _net(policy, **kw)
    ref_loss, ref_params = _net("none")
    got, want = jax.jit(jax.value_and_grad(loss))(params), jax.jit(
        jax.value_and_grad(ref_loss))(ref_params)
    assert float(got[0]) == float(want[0])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kw, message", [
    ({"remat_policy": "full", "remat_save": ("query_proj",)},
     "remat_save=['query_proj'] needs remat_policy 'offload' or 'custom'"),
    ({"remat_policy": "custom", "remat_offload": ("qkv",)}, "remat_offload: ['qkv'] are not"),
    ({"remat_policy": "custom", "remat_save": ("mlpwo",), "remat_offload": ("mlpwo",)},
     "both name ['mlpwo']"),
])
def test_bad_per_tensor_lists_are_errors_naming_the_field(kw, message):
    from capibara_exp.nets import DecoderConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        DecoderConfig(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, num_layers=2,
                      mlp_dim=64, **kw)


@pytest.mark.parametrize("overrides, key", [
    (["model.remat_policy=full", "model.remat_save=[query_proj]"], "model.remat_save"),
    (["model.remat_policy=custom", "model.remat_offload=[qkv]"], "model.remat_offload"),
    (["model.remat_policy=custom", "model.remat_save=[mlpwo]", "model.remat_offload=[mlpwo]"],
     "model.remat_offload"),
])
def test_per_tensor_lists_are_checked_when_composed(overrides, key):
    from capibara_exp.base.errors import ConfigError
    from capibara_exp.cli import checks, flags
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    with pytest.raises(ConfigError, match=re.escape(key)):
        checks.compose_checked(flags.parse([*overrides, "model_dir=/tmp/x"]), "config")
    # a valid per-tensor choice composes
    checks.compose_checked(flags.parse(["model.remat_policy=offload",
                                        "model.remat_offload=[decoder_layer_input]",
                                        "model_dir=/tmp/x"]), "config")


def test_the_planner_searches_named_policies_and_bounds_what_they_save():
    """Searchable policies become candidates whose overrides clear the per-tensor lists
    (except `offload`, which reads the experiment's); the memory bound orders them by what
    they keep in HBM, and the layer inputs sent to the host leave it."""
    from capibara_exp.tuning import memory, mesh_space

    policies = ["none", "save_dot_except_mlp", "save_qkv_proj", "offload", "full"]
    cands = mesh_space.candidates(8, 8, None, 16, remat_policies=policies)
    assert {c.remat_policy for c in cands} == set(policies)
    by_policy = {c.remat_policy: c for c in cands if c.model == 2}
    assert "model.remat_save=[]" in by_policy["full"].overrides(moe=False)
    assert "model.remat_save=[]" not in by_policy["offload"].overrides(moe=False)
    with pytest.raises(ValueError, match="'custom'"):
        mesh_space.candidates(8, 8, None, 16, remat_policies=["custom"])
    shapes = memory.Shapes(leaves=(), layers=4, emb_dim=256, num_heads=8, head_dim=32,
                           length=128, dtype_bytes=2, kv_heads=2, mlp_dim=1024, mlp_inputs=2)
    saved = {p: memory.saved_per_token(shapes, c) for p, c in by_policy.items()}
    assert saved["offload"] == 0 < saved["full"] == 256
    assert saved["full"] < saved["save_qkv_proj"] < saved["save_dot_except_mlp"]
    assert saved["save_qkv_proj"] == 256 + (8 + 2 * 2) * 32 / 2
    bound = {p: memory.lower_bound(shapes, c, ()) for p, c in by_policy.items()}
    assert bound["offload"] < bound["full"] < bound["save_qkv_proj"] < bound["none"]
