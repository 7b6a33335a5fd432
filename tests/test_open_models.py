"""Open model families against their reference implementation (transformers' PyTorch
models): each family's tiny random model, built and saved on the machine, goes through the
real import (capibara-exp-convert's code: safetensors in, a T5X-layout checkpoint out), and
the networks compute its logits from the restored checkpoint as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from capibara_exp.convert import families, hf_import
from capibara_exp.convert.network import network
from capibara_exp.runtime import checkpoints
from tests import hf_reference

pytest.importorskip("transformers", reason="the reference implementation: pip install "
                    "'capibara-exp[reference]' (the test extra has it)")
TOLERANCE = 1e-4  # float32, max abs difference of logits
TOKENS = np.random.default_rng(0).integers(1, hf_reference.SIZES["vocab_size"], (2, 12))


def imported(family: str, tmp: Path, scan_layers: bool = False, **overrides):
    """(model keys, params restored from the imported checkpoint, the HF directory)."""
    hf_dir = hf_reference.build_model(family, tmp / "hf", **overrides)
    hf_import.import_model(hf_dir, tmp / "out", name="m", scan_layers=scan_layers)
    record = json.loads((tmp / "out" / hf_import.RECORD).read_text())
    _, keys = families.model_keys(json.loads((hf_dir / "config.json").read_text()))
    keys.update(scan_layers=scan_layers, dtype="float32")
    shapes = hf_import.param_shapes(keys)
    flat = checkpoints.restore_params(Path(record["checkpoint"]), {
        k: jax.ShapeDtypeStruct(v, np.float32) for k, v in shapes.items()})
    return keys, traverse_util.unflatten_dict(dict(flat), sep="/"), hf_dir


def forward(keys: dict, params: dict) -> tuple[np.ndarray, dict]:
    net = network(keys)
    tokens = jnp.asarray(TOKENS)
    logits, state = jax.jit(lambda p: net.apply(
        {"params": p}, tokens, tokens, enable_dropout=False,
        capture_intermediates=lambda mdl, method: method == "__call__"
        and mdl.name is not None and mdl.name.startswith("layers_")))(params)
    return np.asarray(logits), state["intermediates"]


def first_layer_that_parts(ours: dict, theirs: list) -> str:
    """The first layer whose output differs beyond the tolerance (for the message)."""
    for i, reference in enumerate(theirs[:-1]):  # the last is after the final norm
        got = np.asarray(ours[f"layers_{i}"]["__call__"][0])
        if np.max(np.abs(got - reference)) > TOLERANCE:
            return f"layers_{i} (max diff {np.max(np.abs(got - reference)):.2e})"
    return "the final norm or the logits"


@pytest.mark.parametrize("family", sorted(hf_reference.FAMILIES))
def test_imported_family_computes_the_reference_logits(family: str, tmp_path: Path) -> None:
    keys, params, hf_dir = imported(family, tmp_path)
    want, hidden = hf_reference.reference_logits(hf_dir, TOKENS)
    got, intermediates = forward(keys, params)
    assert np.std(want) > 0.1, "the reference model's logits are flat: the test cannot fail"
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOLERANCE, (f"{family}: logits differ from transformers' by {diff:.2e}; "
                               f"they part at {first_layer_that_parts(intermediates, hidden)}")


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_scanned_import_computes_the_same_logits(family: str, tmp_path: Path) -> None:
    """Scanned layers (Gemma 3: a block of 3, two layers unrolled after it; experts stacked
    per block) from the same HF tensors."""
    keys, params, hf_dir = imported(family, tmp_path, scan_layers=True)
    assert "layers" in params and params["layers"]["layers_0"]["self_attention"]["query"][
        "kernel"].ndim == 3
    want, _ = hf_reference.reference_logits(hf_dir, TOKENS)
    got, _ = forward(keys, params)
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


def test_a_layer_that_differs_is_named(tmp_path: Path) -> None:
    """The failure message names where the outputs part: perturb layer 2's MLP."""
    keys, params, hf_dir = imported("llama3", tmp_path)
    params["layers_2"]["mlp"]["wo"]["kernel"] = params["layers_2"]["mlp"]["wo"]["kernel"] * 1.5
    _, hidden = hf_reference.reference_logits(hf_dir, TOKENS)
    _, intermediates = forward(keys, params)
    assert first_layer_that_parts(intermediates, hidden).startswith("layers_2 ")


def test_bfloat16_weights_keep_their_dtype(tmp_path: Path) -> None:
    hf_dir = hf_reference.build_model("qwen3", tmp_path / "hf", dtype="bfloat16")
    record = hf_import.import_model(hf_dir, tmp_path / "out", name="m")
    assert record["dtypes"] == ["bfloat16"]
    meta = checkpoints.tree_metadata(Path(record["checkpoint"]))
    assert {str(m.dtype) for p, m in meta.items() if p[0] == "target"} == {"bfloat16"}


# config.json of meta-llama/Llama-2-7b-hf, as published (the fields the import reads)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-05,
             "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
             "tie_word_embeddings": False, "max_position_embeddings": 4096}


def test_llama2_config_imports_as_the_shipped_model_entry() -> None:
    """The Llama 2 7B config.json gives the keys of conf/model/llama2_7b.yaml (the planner's
    v5p recipes use that entry; the parity test above checks the family's arithmetic)."""
    from omegaconf import OmegaConf

    from tests.conftest import compose_config

    _, imported_keys = families.model_keys(LLAMA2_7B)
    entry = OmegaConf.to_container(compose_config(["model=llama2_7b"]).model, resolve=True)
    differ = {k: (v, entry[k]) for k, v in imported_keys.items()
              if k in entry and k != "dropout_rate" and v != entry[k]}
    assert differ == {}
