"""nets.DecoderConfig: the sizes and architectural options of the decoders, checked on
construction. gin binds its fields (nets.DecoderConfig.emb_dim = 64); conf/model/ entries set
them per model family (docs/models.md maps each option to the families that use it)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from capibara_exp.base import model_facts
from capibara_exp.nets.positions import rope_frequencies

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
assert tuple(_DTYPES) == model_facts.DTYPES


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of the decoder; gin binds its fields (nets.DecoderConfig.emb_dim = 64)."""

    vocab_size: int
    emb_dim: int
    num_heads: int
    head_dim: int
    num_layers: int
    mlp_dim: int
    mlp_activations: tuple[str, ...] = ("gelu", "linear")
    dropout_rate: float = 0.0
    dtype: str = "float32"
    position_embedding: str = "relative"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    rope_max_wavelength: float = 10_000.0
    logits_via_embedding: bool = False
    remat_policy: str = "none"
    # per-tensor choices (model_facts.REMAT_NAMES) of remat_policy 'offload' / 'custom':
    # kept in HBM, and moved to pinned host memory between the passes (nets/remat.py)
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()
    # 'dot' | 'splash' (nets/attention.py: the Pallas splash kernel on TPU, dot elsewhere).
    attention: str = "dot"
    splash_block: int = 512  # the splash kernel's query/key blocks (a multiple of 128)
    splash_fused_bwd: bool = False  # the kernel's fused dq/dkv backward
    # One nn.scan over blocks of layers instead of num_layers copies: parameters stacked on
    # a leading 'layers' axis (decoder/layers/layers_<j>/...), compile time independent of
    # depth. A block is the period of the layer pattern (MoE interval, sliding-window
    # pattern); layers past the last whole block stay unrolled (layers_<i>).
    scan_layers: bool = False
    # --- options of the open model families (defaults: the T5-style decoder above)
    num_kv_heads: int | None = None  # grouped-query attention; None: num_heads (MHA)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's query and key (Qwen3, Gemma 3)
    # None: T5's convention, no score scaling (folded into the query's initialisation);
    # else scores are scaled by query_pre_attn_scalar ** -0.5 (head_dim for most families).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    sliding_window: int | None = None  # keys a query sees in a local layer (itself included)
    # None: every layer is local when sliding_window is set (Mistral); N: every N-th layer
    # is global, the others local (Gemma 2: 2, Gemma 3: 6)
    sliding_window_pattern: int | None = None
    rope_scaling: str = "none"  # none | linear | llama3 (the global layers' rotary scaling)
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    local_rope_max_wavelength: float | None = None  # rope base of local layers (Gemma 3)
    norm_epsilon: float = 1e-6
    norm_scale_plus_one: bool = False  # scales stored as offsets from 1 (Gemma)
    norm_placement: str = "pre"  # pre | pre_post (Gemma 2/3: norms on block outputs too)
    scale_embeddings: bool = False  # input embeddings times sqrt(emb_dim) (Gemma)
    # With tied embeddings, logits divided by sqrt(emb_dim) (T5X, MaxText's default).
    normalize_embedding_logits: bool = True

    def __post_init__(self) -> None:
        for name in ("mlp_activations", "remat_save", "remat_offload"):  # gin/YAML lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for check in (_check_sizes, _check_choices_of, _check_attention, _check_rates,
                      _check_rope, _check_remat):
            problem = check(self)
            if problem:
                raise ValueError(f"DecoderConfig.{problem}")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return model_facts.sizes(self).is_local(layer)

    @property
    def layer_period(self) -> int:
        """Layers per repeat of the dense layers' pattern (local and global layers)."""
        return (self.sliding_window_pattern or 1) if self.sliding_window else 1

    def rope_frequencies(self, local: bool) -> np.ndarray:
        """Inverse wavelengths of a layer's rotary pairs (local layers may have their own
        base, unscaled, as in Gemma 3)."""
        if local and self.local_rope_max_wavelength:
            return rope_frequencies(self.head_dim, self.local_rope_max_wavelength)
        return rope_frequencies(self.head_dim, self.rope_max_wavelength, self.rope_scaling,
                                self.rope_scaling_factor, self.rope_low_freq_factor,
                                self.rope_high_freq_factor, self.rope_original_max_positions)


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


def _check_sizes(c: DecoderConfig) -> str | None:
    for field in dataclasses.fields(c):  # every int field is a size or a count
        value = getattr(c, field.name)
        if field.type in (int, "int") and value <= 0:
            return f"{field.name} must be positive, got {value}"
    for name in ("num_kv_heads", "sliding_window", "sliding_window_pattern"):
        value = getattr(c, name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            return f"{name} must be a positive integer or None, got {value!r}"
    if c.num_heads % c.kv_heads:
        return (f"num_heads={c.num_heads} must be a multiple of num_kv_heads={c.kv_heads} "
                "(query heads share key/value heads in equal groups)")
    if not c.mlp_activations:
        return "mlp_activations must name at least one activation"
    return None


def _check_choices_of(c: DecoderConfig) -> str | None:
    for field, values, allowed in (
            ("mlp_activations", c.mlp_activations, model_facts.ACTIVATIONS),
            ("dtype", (c.dtype,), model_facts.DTYPES),
            ("position_embedding", (c.position_embedding,), model_facts.POSITION_EMBEDDINGS),
            ("remat_policy", (c.remat_policy,), model_facts.REMAT_POLICIES),
            ("attention", (c.attention,), model_facts.ATTENTIONS),
            ("rope_scaling", (c.rope_scaling,), model_facts.ROPE_SCALINGS),
            ("norm_placement", (c.norm_placement,), model_facts.NORM_PLACEMENTS)):
        for value in values:
            if value not in allowed:
                return f"{field}: {value!r} is not one of {sorted(allowed)}"
    return None


def _check_attention(c: DecoderConfig) -> str | None:
    if c.attention == "splash" and c.position_embedding != "rope":
        return ("attention='splash' needs position_embedding='rope': the kernel adds no "
                "relative position bias")
    if c.attention == "splash" and c.dropout_rate:
        return ("attention='splash' has no dropout on attention probabilities; set "
                f"dropout_rate=0 (got {c.dropout_rate}) or use attention='dot'")
    if c.splash_block % 128:
        return f"splash_block must be a multiple of 128 (the kernel's tiles), got {c.splash_block}"
    for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
        value = getattr(c, name)
        if value is not None and not _positive(value):
            return f"{name} must be a positive number or None, got {value!r}"
    if c.sliding_window_pattern and not c.sliding_window:
        return "sliding_window_pattern needs sliding_window (the local layers' window)"
    return None


def _check_rates(c: DecoderConfig) -> str | None:
    if not 0.0 <= c.dropout_rate < 1.0:
        return f"dropout_rate must be in [0, 1), got {c.dropout_rate}"
    if not _positive(c.norm_epsilon):
        return f"norm_epsilon must be positive, got {c.norm_epsilon}"
    if c.relative_attention_max_distance <= c.relative_attention_num_buckets // 2:
        return ("relative_attention_max_distance must exceed half of "
                f"relative_attention_num_buckets ({c.relative_attention_num_buckets}), "
                f"got {c.relative_attention_max_distance}")
    return None


def _check_rope(c: DecoderConfig) -> str | None:
    if c.position_embedding == "rope" and c.head_dim % 2:
        return f"head_dim must be even for rope, got {c.head_dim}"
    for name in ("rope_max_wavelength", "rope_scaling_factor", "rope_low_freq_factor",
                 "rope_high_freq_factor"):
        if not _positive(getattr(c, name)):
            return f"{name} must be positive, got {getattr(c, name)}"
    if c.local_rope_max_wavelength is not None and not _positive(c.local_rope_max_wavelength):
        return ("local_rope_max_wavelength must be positive or None, "
                f"got {c.local_rope_max_wavelength}")
    if c.rope_scaling == "llama3" and c.rope_high_freq_factor <= c.rope_low_freq_factor:
        return (f"rope_high_freq_factor={c.rope_high_freq_factor} must exceed "
                f"rope_low_freq_factor={c.rope_low_freq_factor} (rope_scaling='llama3')")
    return None


def _check_remat(c: DecoderConfig) -> str | None:
    for field in ("remat_save", "remat_offload"):
        values = getattr(c, field)
        unknown = [v for v in values if v not in model_facts.REMAT_NAMES]
        if unknown:
            return f"{field}: {unknown} are not among {list(model_facts.REMAT_NAMES)}"
        if values and c.remat_policy not in model_facts.REMAT_WITH_LISTS:
            return (f"{field}={list(values)} needs remat_policy 'offload' or 'custom' "
                    f"(got {c.remat_policy!r}, whose tensors are fixed)")
    both = sorted(set(c.remat_save) & set(c.remat_offload))
    if both:
        return f"remat_save and remat_offload both name {both}: each tensor has one place"
    return None


def check_choices(field: str, values: tuple[str, ...], allowed) -> None:
    """A ValueError naming the field when a value is not one of `allowed`."""
    for value in values:
        if value not in allowed:
            raise ValueError(f"DecoderConfig.{field}: {value!r} is not one of {sorted(allowed)}")
