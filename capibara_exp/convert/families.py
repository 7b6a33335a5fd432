"""Model families as Hugging Face publishes them, in the project's terms: a model directory's
`config.json` to the `model` group's keys (import), and back (export).

Pure: JSON and dicts, no JAX, no transformers. Both config.json spellings are read: the one
published with the checkpoints (`rope_theta`, `rope_scaling`, `num_experts`, ...) and the one
transformers 5 writes (`rope_parameters`, per layer type for Gemma 3, `num_local_experts`).
Anything a family's config asks for that the networks do not implement is refused by name
(FamilyError), never approximated.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capibara_exp.base.errors import ConfigError


class FamilyError(ConfigError):
    """A config.json this project cannot represent faithfully."""


# Hugging Face activation names -> the networks' (nets/layers.py ACTIVATIONS)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu",
                "gelu": "gelu_exact", "relu": "relu"}
_HF_ACTIVATION = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu",
                  "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: its HF names and the options its networks always have."""

    name: str  # the project's name (conf/model/<name>_*.yaml)
    architecture: str  # config.json's `architectures[0]`
    model_type: str
    fixed: Mapping[str, Any]  # model keys every model of the family has
    moe: bool = False
    # hidden_activation (Gemma) or hidden_act (the others)
    activation_key: str = "hidden_act"


_LLAMA_LIKE = {"position_embedding": "rope", "norm_placement": "pre",
               "normalize_embedding_logits": False, "scale_embeddings": False,
               "norm_scale_plus_one": False, "qkv_bias": False, "qk_norm": False}
_GEMMA = {**_LLAMA_LIKE, "norm_placement": "pre_post", "scale_embeddings": True,
          "norm_scale_plus_one": True, "logits_via_embedding": True}

FAMILIES = {f.architecture: f for f in (
    Family("llama3", "LlamaForCausalLM", "llama", _LLAMA_LIKE),
    Family("mistral", "MistralForCausalLM", "mistral", _LLAMA_LIKE),
    Family("qwen2_5", "Qwen2ForCausalLM", "qwen2", {**_LLAMA_LIKE, "qkv_bias": True}),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", {**_LLAMA_LIKE, "qk_norm": True}),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", _GEMMA, activation_key="hidden_activation"),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", {**_GEMMA, "qk_norm": True},
           activation_key="hidden_activation"),
    Family("mixtral", "MixtralForCausalLM", "mixtral", _LLAMA_LIKE, moe=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", {**_LLAMA_LIKE, "qk_norm": True},
           moe=True),
)}
BY_NAME = {f.name: f for f in FAMILIES.values()}


def family_of(config: Mapping[str, Any], where: str) -> Family:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    by_type = [f for f in FAMILIES.values() if f.model_type == config.get("model_type")]
    if not archs and by_type:
        return by_type[0]
    known = ", ".join(f"{f.architecture} ({f.name})" for f in FAMILIES.values())
    raise FamilyError(f"{where}: architecture {archs or config.get('model_type')!r} is not one "
                      f"this project implements; known: {known}")


def _refuse(where: str, key: str, value: Any, why: str) -> None:
    raise FamilyError(f"{where}: {key}={value!r} is not supported: {why}")


def _rope(config: Mapping[str, Any], where: str, layer_type: str = "full_attention") -> dict:
    """Rope base and scaling of one layer type, from either spelling of config.json."""
    params = config.get("rope_parameters") or {}
    if layer_type in params:  # transformers 5, per layer type (Gemma 3)
        params = params[layer_type]
    elif params and not isinstance(params.get("rope_theta", 0.0), int | float):
        params = {}
    scaling = dict(params) if params else dict(config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_max_wavelength": float(theta)}
    if kind in ("default", None):
        out["rope_scaling"] = "none"
    elif kind == "linear":
        out.update(rope_scaling="linear", rope_scaling_factor=float(scaling["factor"]))
    elif kind == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                   rope_low_freq_factor=float(scaling["low_freq_factor"]),
                   rope_high_freq_factor=float(scaling["high_freq_factor"]),
                   rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
    else:
        _refuse(where, "rope_scaling.rope_type", kind, "implemented: default, linear, llama3")
    return out


def _layer_pattern(config: Mapping[str, Any], fam: Family, where: str) -> dict:
    """sliding_window and sliding_window_pattern from the config's layer types."""
    window = config.get("sliding_window")
    layers = config["num_hidden_layers"]
    if fam.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if config.get("use_sliding_window"):
            _refuse(where, "use_sliding_window", True, "Qwen's sliding window on the layers "
                    "past max_window_layers has no equivalent here")
        return {"sliding_window": None, "sliding_window_pattern": None}
    if not window:
        return {"sliding_window": None, "sliding_window_pattern": None}
    types = config.get("layer_types")
    pattern = (config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
               or (2 if fam.model_type == "gemma2" else None))
    if types:
        globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
        pattern = globals_[0] + 1 if globals_ else None
    implied = ["full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention"
               for i in range(layers)]
    if types and list(types) != implied:
        _refuse(where, "layer_types", types, "local and global layers must repeat with a period "
                "(every N-th layer global)")
    return {"sliding_window": int(window), "sliding_window_pattern": pattern}


def _moe(config: Mapping[str, Any], fam: Family, where: str) -> dict:
    experts = config.get("num_local_experts", config.get("num_experts"))
    k = config["num_experts_per_tok"]
    out = {"num_experts": experts, "num_selected_experts": k, "moe_layer_interval": 1,
           "dropless": True,  # every token served by its k experts, as the reference
           "capacity_factor": 1.25, "eval_capacity_factor": 2.0,  # (unused when dropless)
           "min_expert_capacity": 1, "router_jitter_noise": float(
               config.get("router_jitter_noise", 0.0)), "expert_dropout_rate": 0.0,
           "aux_loss_factor": float(config.get("router_aux_loss_coef", 0.0)),
           "router_z_loss_factor": 0.0,
           "renormalize_top_k": bool(config.get("norm_topk_prob", fam.model_type == "mixtral"))}
    if fam.model_type == "qwen3_moe":
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            _refuse(where, "mlp_only_layers", config.get("mlp_only_layers"),
                    "every layer must be sparse (decoder_sparse_step 1, no mlp_only_layers)")
        out["mlp_dim"] = config["moe_intermediate_size"]
    return out


def read_config(hf_dir: Path) -> dict:
    """config.json of a Hugging Face model directory, refused in one line if it is none."""
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise ConfigError(f"hf_dir={hf_dir}: not a directory")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"hf_dir={hf_dir}: no config.json (a Hugging Face model "
                          "directory: config.json and *.safetensors)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(config, dict) or "text_config" in config:
        raise ConfigError(f"{path}: not a causal language model's config (a multimodal "
                          "model's text_config is not imported; convert its text model)")
    return config


def model_keys(config: Mapping[str, Any], where: str = "config.json") -> tuple[Family, dict]:
    """The family and the `model` group's keys of a Hugging Face config.json."""
    fam = family_of(config, where)
    for key, bad in (("attention_bias", True), ("mlp_bias", True)):
        if config.get(key) is bad and not (key == "attention_bias" and fam.name == "qwen2_5"):
            _refuse(where, key, bad, "projections here have no output bias")
    heads = config["num_attention_heads"]
    act = config.get(fam.activation_key) or config.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        _refuse(where, fam.activation_key, act, f"known: {', '.join(_ACTIVATIONS)}")
    keys: dict[str, Any] = {
        **fam.fixed, "vocab_size": config["vocab_size"], "emb_dim": config["hidden_size"],
        "num_heads": heads, "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "num_layers": config["num_hidden_layers"], "mlp_dim": config["intermediate_size"],
        "mlp_activations": [_ACTIVATIONS[act], "linear"],
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(config.get("tie_word_embeddings",
                                                fam.fixed.get("logits_via_embedding", False))),
        "dropout_rate": 0.0, **_rope(config, where), **_layer_pattern(config, fam, where)}
    keys["query_pre_attn_scalar"] = float(config.get("query_pre_attn_scalar")
                                          or keys["head_dim"])
    keys["attn_logit_softcap"] = config.get("attn_logit_softcapping")
    keys["final_logit_softcap"] = config.get("final_logit_softcapping")
    if fam.model_type == "gemma3_text":
        local = _rope(config, where, "sliding_attention")
        base = config.get("rope_local_base_freq")
        keys["local_rope_max_wavelength"] = float(base or local["rope_max_wavelength"])
    if fam.moe:
        keys.update(_moe(config, fam, where))
    return fam, keys


def hf_config(fam: Family, model: Mapping[str, Any], extra: Mapping[str, Any]) -> dict:
    """A config.json (transformers' published spelling) for a model of a family; `extra`
    keeps the imported config's own keys (token ids, max positions) where they still hold."""
    heads = model["num_heads"]
    act = _HF_ACTIVATION[model["mlp_activations"][0]]
    out = {k: v for k, v in extra.items() if k in (
        "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
        "initializer_range", "torch_dtype", "dtype")}
    out.update({
        "architectures": [fam.architecture], "model_type": fam.model_type,
        "vocab_size": model["vocab_size"], "hidden_size": model["emb_dim"],
        "intermediate_size": model["mlp_dim"], "num_hidden_layers": model["num_layers"],
        "num_attention_heads": heads, "num_key_value_heads": model.get("num_kv_heads") or heads,
        "head_dim": model["head_dim"], fam.activation_key: act,
        "rms_norm_eps": model["norm_epsilon"],
        "tie_word_embeddings": bool(model["logits_via_embedding"]),
        "rope_theta": model["rope_max_wavelength"]})
    if model.get("rope_scaling", "none") != "none":
        out["rope_scaling"] = _hf_rope_scaling(model)
    if model.get("sliding_window"):
        out["sliding_window"] = model["sliding_window"]
        if model.get("sliding_window_pattern"):
            out["sliding_window_pattern"] = model["sliding_window_pattern"]
            out["layer_types"] = [
                "full_attention" if (i + 1) % model["sliding_window_pattern"] == 0
                else "sliding_attention" for i in range(model["num_layers"])]
    if fam.model_type in ("gemma2", "gemma3_text"):
        scalar = float(model["query_pre_attn_scalar"])  # an int in Gemma's config.json
        out["query_pre_attn_scalar"] = int(scalar) if scalar.is_integer() else scalar
        out["attn_logit_softcapping"] = model.get("attn_logit_softcap")
        out["final_logit_softcapping"] = model.get("final_logit_softcap")
    if fam.model_type == "gemma3_text":
        out["rope_local_base_freq"] = model["local_rope_max_wavelength"]
    if fam.model_type == "qwen2":
        out["use_sliding_window"] = False
    if fam.moe:
        out.update(num_experts_per_tok=model["num_selected_experts"],
                   router_aux_loss_coef=model.get("aux_loss_factor", 0.0))
        if fam.model_type == "mixtral":
            out["num_local_experts"] = model["num_experts"]
        else:
            out.update(num_experts=model["num_experts"], moe_intermediate_size=model["mlp_dim"],
                       norm_topk_prob=bool(model["renormalize_top_k"]),
                       decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _hf_rope_scaling(model: Mapping[str, Any]) -> dict:
    if model["rope_scaling"] == "linear":
        return {"rope_type": "linear", "factor": model["rope_scaling_factor"]}
    return {"rope_type": "llama3", "factor": model["rope_scaling_factor"],
            "low_freq_factor": model["rope_low_freq_factor"],
            "high_freq_factor": model["rope_high_freq_factor"],
            "original_max_position_embeddings": model["rope_original_max_positions"]}
