"""model_facts owns the networks' sizes and choice lists: its parameter counts are the
parameters the networks create, for every shipped model entry, and the lists it owns are
the ones the networks and the schema check against."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util
from omegaconf import OmegaConf

from capibara_exp.base import model_facts
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.composing import config_schema
from capibara_exp.convert.network import network
from tests.conftest import compose_config

ENTRIES = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def model_keys(entry: str) -> dict:
    return OmegaConf.to_container(compose_config([f"model={entry}"]).model, resolve=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_parameter_count_is_what_the_network_creates(entry: str) -> None:
    keys = model_keys(entry)
    net = network(keys)
    tokens = jax.ShapeDtypeStruct((1, 128), np.int32)  # splash's smallest block
    shapes = jax.eval_shape(lambda t: net.init(jax.random.PRNGKey(0), t, t,
                                               enable_dropout=False), tokens)["params"]
    created = sum(int(np.prod(v.shape)) for v in
                  traverse_util.flatten_dict(dict(shapes)).values())
    assert model_facts.counts(model_facts.sizes(keys)).total == created, entry


def test_published_sizes_come_out_as_published() -> None:
    """Parameter counts of the full-size entries, against the model cards' figures."""
    published = {"llama3_8b": 8.03e9, "mistral_7b": 7.24e9, "qwen2_5_7b": 7.62e9,
                 "qwen3_8b": 8.19e9, "gemma2_9b": 9.24e9, "mixtral_8x7b": 46.7e9,
                 "qwen3_moe_30b_a3b": 30.5e9, "llama2_7b": 6.74e9, "llama2_70b": 68.98e9,
                 "llama3_70b": 70.55e9}
    for entry, figure in published.items():
        total = model_facts.counts(model_facts.sizes(model_keys(entry))).total
        assert abs(total / figure - 1) < 0.01, (entry, total, figure)
    active = model_facts.counts(model_facts.sizes(model_keys("mixtral_8x7b"))).active_matmul
    assert 12.0e9 < active < 13.5e9  # Mixtral's "12.9B active" (embedding included)


def test_the_schema_and_the_networks_check_the_lists_model_facts_owns() -> None:
    from capibara_exp.nets import decoder, layers

    rules = config_schema.RULES
    assert rules["model.remat_policy"].choices == model_facts.REMAT_POLICIES
    assert rules["model.rope_scaling"].choices == model_facts.ROPE_SCALINGS
    assert rules["model.mlp_activations"].item.choices == model_facts.ACTIVATIONS
    assert tuple(layers.ACTIVATIONS) == model_facts.ACTIVATIONS
    from capibara_exp.nets.remat import policy_for

    assert [p for p in model_facts.REMAT_POLICIES if (policy_for(p) is None) != (p == "none")
            ] == []
    source = "\n".join(p.read_text() for p in Path(decoder.__file__).parent.glob("*.py"))
    for name in model_facts.REMAT_NAMES:  # every tensor a policy may name is tagged
        assert f'"{name}")' in source, name
    for listed in ('"relative", "rope"', '"dot", "splash"', '"none", "linear", "llama3"'):
        assert listed not in source, f"nets/ restates a list model_facts owns: {listed}"


# A size formula written again: 6 x parameters (the FLOP rule), the embedding table, the
# MLP's kernels. model_facts is the one place these products appear.
_FORMULAS = (r"\b6(\.0)?\s*\*\s*[A-Za-z_.]*param",
             r"\b(vocab_size|emb_dim)\s*\*\s*[A-Za-z_.]*\b(vocab_size|emb_dim)\b",
             r"\b(emb_dim|mlp_dim)\s*\*\s*[A-Za-z_.]*\b(mlp_dim|emb_dim)\b")


def _restatements(source: str) -> list[str]:
    """The lists model_facts owns (any two neighbours, quoted as in code) and the size
    formulas, as found in `source`."""
    import re

    found = []
    for name, value in vars(model_facts).items():
        if name.isupper() and isinstance(value, tuple) and len(value) > 1:
            for a, b in zip(value, value[1:], strict=False):
                # neighbours in a tuple or list, not a mapping's key and value
                if re.search(rf"(?<!:\s)['\"]{a}['\"],\s*['\"]{b}['\"](?!\s*:)", source):
                    found.append(f"{name}: {a}, {b}")
    found += [p for p in _FORMULAS if re.search(p, source)]
    return found


def test_no_module_restates_a_list_or_a_size_formula_model_facts_owns() -> None:
    root = Path(model_facts.__file__).parent
    restated = {str(p.relative_to(root)): _restatements(p.read_text())
                for p in sorted(root.rglob("*.py")) if p != Path(model_facts.__file__)}
    assert {k: v for k, v in restated.items() if v} == {}
    # the check finds what it looks for
    assert _restatements('Choice("float32", "bfloat16")') == ["DTYPES: float32, bfloat16"]
    assert _restatements("w = 6.0 * params * tokens") == [_FORMULAS[0]]
    assert _restatements("n = cfg.vocab_size * cfg.emb_dim") == [_FORMULAS[1]]
