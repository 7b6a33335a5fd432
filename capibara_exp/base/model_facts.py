"""What the networks are, as numbers: their choice lists and their parameter, FLOP and memory
counts, for the schema, the networks, the run monitor (MFU, memory checks) and the planner.

A leaf: the standard library only, so compose time (config_schema) can import it. The counts
are analytic, from the sizes and options of nets.DecoderConfig / nets.MoeConfig (or the
`model` group of a composed config, which has the same keys); tests check them against the
parameters the networks really create, for every shipped model entry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# ------------------------------------------------------------------ the networks' choices
ACTIVATIONS = ("gelu", "gelu_exact", "relu", "silu", "linear")  # gelu: tanh approximation
DTYPES = ("float32", "bfloat16")
POSITION_EMBEDDINGS = ("relative", "rope")
# nets/remat.py: MaxText's names; these take per-tensor lists of REMAT_NAMES
# (model.remat_save / remat_offload)
REMAT_WITH_LISTS = ("offload", "custom")
REMAT_DOTS = ("dots", "minimal")  # every matmul output saved, no tensor named
REMAT_POLICIES = ("none", "full", *REMAT_DOTS, "save_dot_except_mlpwi", "save_dot_except_mlp",
                  "save_qkv_proj", *REMAT_WITH_LISTS)
# The planner's search (tuning/mesh_space.py), from the most saved to the least ('custom' takes
# its lists from the experiment and is not searched; 'offload' moves the layer inputs to host).
REMAT_SEARCHED = ("none", "dots", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp",
                  "save_qkv_proj", "offload", "full")
# the tensors the layers tag with checkpoint_name (MaxText's names)
REMAT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context",
               "out_proj", "mlpwi", "mlpwo")
_REMAT_SAVED = {
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
}
REMAT_DEFAULT_OFFLOAD = ("decoder_layer_input",)  # `offload` without remat_offload


def remat_names(policy: str, save: tuple[str, ...] = (), offload: tuple[str, ...] = ()
                ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensors kept in HBM, tensors moved to host memory) a named policy saves (nets/remat.py);
    empty for none / full / dots / minimal, which name no tensor."""
    if policy in _REMAT_SAVED:
        return _REMAT_SAVED[policy], ()
    if policy == "offload":
        return tuple(save), tuple(offload) or REMAT_DEFAULT_OFFLOAD
    if policy == "custom":
        return tuple(save), tuple(offload)
    return (), ()
ATTENTIONS = ("dot", "splash")
# none | linear (positions / factor) | llama3 (Llama 3.1's banded wavelength scaling)
ROPE_SCALINGS = ("none", "linear", "llama3")
# pre: a norm before attention and before the MLP (Llama, T5); pre_post: and another on each
# block's output before the residual add (Gemma 2 and 3's "sandwich" norms)
NORM_PLACEMENTS = ("pre", "pre_post")
# byte: seqio's ByteVocabulary; sentencepiece: a .model file; tokenizer_json: a Hugging
# Face tokenizer.json (the `tokenizers` library)
FILE_VOCABULARIES = ("sentencepiece", "tokenizer_json")  # read from model.vocabulary_path
VOCABULARIES = ("byte", *FILE_VOCABULARIES)
BYTE_VOCAB_SIZE = 259  # ByteVocabulary: 256 bytes and 3 special ids

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # keys: DTYPES


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shape facts of a decoder (dense, or MoE when num_experts is set)."""

    vocab_size: int
    emb_dim: int
    num_heads: int
    head_dim: int
    num_layers: int
    mlp_dim: int
    num_mlp_inputs: int = 2  # gated MLPs have two input projections
    num_kv_heads: int | None = None
    tied: bool = False  # logits_via_embedding
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    relative_buckets: int = 0  # T5's relative bias table, shared by the layers
    dtype: str = "float32"
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    num_experts: int | None = None
    num_selected_experts: int = 1
    moe_layer_interval: int = 1

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def is_sparse(self, layer: int) -> bool:
        return bool(self.num_experts) and (layer + 1) % self.moe_layer_interval == 0

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends through the sliding window."""
        if not self.sliding_window:
            return False
        return not self.sliding_window_pattern or (layer + 1) % self.sliding_window_pattern != 0


def sizes(model: Any, moe: Any = None) -> Sizes:
    """Sizes of a network config (nets.DecoderConfig and nets.MoeConfig, or any object or
    mapping with their field names, such as a composed config's `model` group)."""
    get = (lambda k, d=None: model.get(k, d)) if isinstance(model, Mapping) else (
        lambda k, d=None: getattr(model, k, d))
    experts = moe if moe is not None else model
    get_moe = (lambda k, d=None: experts.get(k, d)) if isinstance(experts, Mapping) else (
        lambda k, d=None: getattr(experts, k, d))
    num_experts = get_moe("num_experts")
    return Sizes(
        vocab_size=get("vocab_size"), emb_dim=get("emb_dim"), num_heads=get("num_heads"),
        head_dim=get("head_dim"), num_layers=get("num_layers"), mlp_dim=get("mlp_dim"),
        num_mlp_inputs=len(get("mlp_activations", ("gelu", "linear"))),
        num_kv_heads=get("num_kv_heads"), tied=bool(get("logits_via_embedding", False)),
        qkv_bias=bool(get("qkv_bias", False)), qk_norm=bool(get("qk_norm", False)),
        post_norms=get("norm_placement", "pre") == "pre_post",
        relative_buckets=(get("relative_attention_num_buckets", 32)
                          if get("position_embedding", "relative") == "relative" else 0),
        dtype=get("dtype", "float32"), sliding_window=get("sliding_window"),
        sliding_window_pattern=get("sliding_window_pattern"),
        num_experts=num_experts,
        num_selected_experts=get_moe("num_selected_experts", 1) if num_experts else 1,
        moe_layer_interval=get_moe("moe_layer_interval", 1) if num_experts else 1)


@dataclasses.dataclass(frozen=True)
class Counts:
    """Parameter counts: all of them, the matmul weights, and those one token uses."""

    total: int
    matmul: int  # kernels (and the tied embedding, which the logits multiply by)
    active_matmul: float  # matmul weights a token meets: k of E experts in a MoE layer
    embedding: int


def _attention(s: Sizes) -> tuple[int, int]:
    """(matmul weights, other parameters) of one attention block."""
    q = s.emb_dim * s.num_heads * s.head_dim
    kv = 2 * s.emb_dim * s.kv_heads * s.head_dim
    other = (s.num_heads + 2 * s.kv_heads) * s.head_dim if s.qkv_bias else 0
    other += 2 * s.head_dim if s.qk_norm else 0
    return 2 * q + kv, other


def _mlp(s: Sizes) -> int:
    return (s.num_mlp_inputs + 1) * s.emb_dim * s.mlp_dim


def counts(s: Sizes) -> Counts:
    attention, attention_other = _attention(s)
    norms = (4 if s.post_norms else 2) * s.emb_dim
    matmul = active = 0.0
    other = 0
    for layer in range(s.num_layers):
        matmul += attention
        active += attention
        other += attention_other + norms
        if s.is_sparse(layer):
            router = s.emb_dim * s.num_experts
            matmul += router + s.num_experts * _mlp(s)
            active += router + s.num_selected_experts * _mlp(s)
        else:
            matmul += _mlp(s)
            active += _mlp(s)
    embedding = s.vocab_size * s.emb_dim
    logits = embedding  # the output projection, or the tied table used as one
    matmul += logits
    active += logits
    other += s.emb_dim + s.num_heads * s.relative_buckets  # final norm, relative bias
    total = int(matmul) + other + (0 if s.tied else embedding)
    return Counts(total=total, matmul=int(matmul), active_matmul=active, embedding=embedding)


def attended_length(s: Sizes, layer: int, length: int) -> int:
    """Keys a query sees at most in one layer (the window in a sliding-window layer)."""
    return min(length, s.sliding_window) if s.is_local(layer) else length


def train_flops_per_token(s: Sizes, length: int) -> float:
    """Training FLOPs per token, PaLM's count: 6 x the matmul weights a token meets, plus
    12 x heads x head_dim x attended length per layer (forward and backward of the
    scores and the weighted sum, not halved for causality)."""
    attention = sum(12 * s.num_heads * s.head_dim * attended_length(s, layer, length)
                    for layer in range(s.num_layers))
    return 6.0 * counts(s).active_matmul + attention


def maxtext_train_flops_per_step(s: Sizes, batch_size: int, length: int) -> float:
    """MaxText's count of training FLOPs per step (its reported MFU divides by this): 6 x
    parameters x tokens (norms and the logits' embedding included; an untied input table is
    a lookup, not counted) + 6 x heads x layers x head_dim x length^2 per sequence (causal:
    half of PaLM's attention term)."""
    every = counts(s)
    params = every.total - (0 if s.tied else every.embedding)
    weights = 6.0 * params * length * batch_size
    attention = sum(6.0 * s.num_heads * s.head_dim * length * attended_length(s, layer, length)
                    for layer in range(s.num_layers)) * batch_size
    return weights + attention


def kv_cache_bytes(s: Sizes, batch_size: int, length: int, dtype: str | None = None) -> int:
    """Bytes of a decoding cache: keys and values of every layer for `length` positions."""
    per_layer = 2 * batch_size * s.kv_heads * s.head_dim * length
    return per_layer * s.num_layers * DTYPE_BYTES[dtype or s.dtype]


def lcm_period(*periods: int | None) -> int:
    """The period of a pattern of layers made of several periodic choices."""
    return math.lcm(*(p for p in periods if p)) if any(periods) else 1
