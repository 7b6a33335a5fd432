"""Which Hugging Face tensors make which parameter of the networks, per family.

Pure: names and nesting only. A parameter (`layers_0/self_attention/query/kernel`) comes
from one HF tensor, transposed for a kernel (PyTorch's Linear stores [out, in], the networks
[in, out]); an expert kernel [E, in, out] stacks E of them; with scanned layers, a layer
parameter of the scanned block (`layers/layers_<j>/...`) stacks the block's repeats on a
leading axis. `Entry.sources` is that nesting of names, outermost first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from capibara_exp.base import model_facts
from capibara_exp.convert.families import Family


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: its path, the HF tensor names it is made of, and whether each is
    transposed (a kernel) or copied (norm scales, biases, the embedding)."""

    path: str
    sources: Any  # a name, or a list (experts, scanned blocks) of nested names
    transpose: bool

    @property
    def depth(self) -> int:
        """Leading axes of the parameter that stack HF tensors (experts, scanned blocks)."""
        depth, x = 0, self.sources
        while not isinstance(x, str):
            depth, x = depth + 1, x[0]
        return depth

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each HF tensor of a parameter of `shape`."""
        inner = tuple(shape[self.depth:])
        return tuple(reversed(inner)) if self.transpose else inner

    def names(self) -> list[str]:
        out: list[str] = []

        def walk(x: Any) -> None:
            if isinstance(x, str):
                out.append(x)
            else:
                for y in x:
                    walk(y)

        walk(self.sources)
        return out


def _norms(fam: Family) -> dict[str, str]:
    """Layer norm parameter -> the HF name of the same norm."""
    if fam.fixed.get("norm_placement") == "pre_post":  # Gemma's four norms per layer
        return {"pre_self_attention_layer_norm": "input_layernorm",
                "post_self_attention_layer_norm": "post_attention_layernorm",
                "pre_mlp_layer_norm": "pre_feedforward_layernorm",
                "post_mlp_layer_norm": "post_feedforward_layernorm"}
    return {"pre_self_attention_layer_norm": "input_layernorm",
            "pre_mlp_layer_norm": "post_attention_layernorm"}


def _mlp(fam: Family, model: Mapping[str, Any]) -> list[tuple[str, Any, bool]]:
    """(parameter under layers_<i>/, HF name under model.layers.<i>. or a list of them per
    expert, transpose) of the feed-forward block."""
    if not fam.moe:
        return [("mlp/wi_0/kernel", "mlp.gate_proj.weight", True),
                ("mlp/wi_1/kernel", "mlp.up_proj.weight", True),
                ("mlp/wo/kernel", "mlp.down_proj.weight", True)]
    if fam.model_type == "mixtral":
        base, names = "block_sparse_moe", ("w1", "w3", "w2")
    else:
        base, names = "mlp", ("gate_proj", "up_proj", "down_proj")
    experts = range(model["num_experts"])
    out = [("mlp/router/kernel", f"{base}.gate.weight", True)]
    for ours, theirs in zip(("wi_0", "wi_1", "wo"), names, strict=True):
        out.append((f"mlp/expert/{ours}", [f"{base}.experts.{e}.{theirs}.weight"
                                           for e in experts], True))
    return out


def layer_entries(fam: Family, model: Mapping[str, Any]) -> list[tuple[str, Any, bool]]:
    """(parameter under layers_<i>/, HF name(s) under model.layers.<i>., transpose)."""
    out = [(f"self_attention/{ours}/kernel", f"self_attn.{theirs}_proj.weight", True)
           for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))]
    if model.get("qkv_bias"):
        out += [(f"self_attention/{ours}/bias", f"self_attn.{theirs}_proj.bias", False)
                for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v"))]
    if model.get("qk_norm"):
        out += [("self_attention/query_norm/scale", "self_attn.q_norm.weight", False),
                ("self_attention/key_norm/scale", "self_attn.k_norm.weight", False)]
    out += [(f"{ours}/scale", f"{theirs}.weight", False) for ours, theirs in _norms(fam).items()]
    return out + _mlp(fam, model)


def _prefixed(sources: Any, layer: int) -> Any:
    if isinstance(sources, str):
        return f"model.layers.{layer}.{sources}"
    return [_prefixed(s, layer) for s in sources]


def block_size(model: Mapping[str, Any]) -> int:
    """Layers per scanned block, as nets.Decoder / nets.MoeDecoder scan them."""
    period = model.get("sliding_window_pattern") if model.get("sliding_window") else None
    interval = model.get("moe_layer_interval") if model.get("num_experts") else None
    return model_facts.lcm_period(interval, period)


def entries(fam: Family, model: Mapping[str, Any]) -> list[Entry]:
    """Every parameter of a model of the family, in the networks' layout (scanned when
    model['scan_layers'])."""
    out = [Entry("token_embedder/embedding", "model.embed_tokens.weight", False),
           Entry("decoder_norm/scale", "model.norm.weight", False)]
    if not model.get("logits_via_embedding"):
        out.append(Entry("logits_dense/kernel", "lm_head.weight", True))
    per_layer = layer_entries(fam, model)
    size, layers = block_size(model), model["num_layers"]
    blocks = layers // size if model.get("scan_layers") else 0
    for j in range(size if blocks else 0):
        for param, sources, transpose in per_layer:
            stacked = [_prefixed(sources, b * size + j) for b in range(blocks)]
            out.append(Entry(f"layers/layers_{j}/{param}", stacked, transpose))
    for i in range(blocks * size, layers):
        out += [Entry(f"layers_{i}/{param}", _prefixed(sources, i), transpose)
                for param, sources, transpose in per_layer]
    return out
