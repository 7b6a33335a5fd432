"""A T5-style decoder-only Transformer with T5X's decoder call signature and logical axes.

Pre-norm blocks (RMSNorm -> causal self-attention, RMSNorm -> gated-GELU MLP), T5
relative position bias (one table shared by all layers, as in T5) or rotary embeddings,
packing through segment ids and positions, prefix-LM through `decoder_causal_attention`.
Parameters are float32, named as in T5X's decoder-only example (`layers_0/self_attention/
query/kernel`, ...) and carry its logical axis names in the 'params_axes' collection, so
`models.DecoderOnlyModel.module = @nets.Decoder()` works in real T5X and the local runtime.

Shape suffixes: B batch, L query length, S key length, D embed, H heads, K head dim,
F mlp, V vocab, N relative-position buckets.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

param_with_axes = nn_partitioning.param_with_axes
constrain = nn_partitioning.with_sharding_constraint

_ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "linear": lambda x: x}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_POSITIONS = ("relative", "rope")
# 'dots' keeps the weight matmuls' outputs (dots without batch dimensions) and recomputes
# attention scores, which are the large [B, H, L, S] tensors.
_REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


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
    # One nn.scan over blocks of layers instead of num_layers copies: parameters stacked on
    # a leading 'layers' axis (decoder/layers/layers_<j>/...), compile time independent of
    # depth. A block is one layer, or moe_layer_interval layers for nets.MoeDecoder.
    scan_layers: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))  # gin/YAML lists
        for field in dataclasses.fields(self):  # every int field is a size or a count
            if field.type in (int, "int") and getattr(self, field.name) <= 0:
                value = getattr(self, field.name)
                raise ValueError(f"DecoderConfig.{field.name} must be positive, got {value}")
        if not self.mlp_activations:
            raise ValueError("DecoderConfig.mlp_activations must name at least one activation")
        _check_choices("mlp_activations", self.mlp_activations, _ACTIVATIONS)
        _check_choices("dtype", (self.dtype,), _DTYPES)
        _check_choices("position_embedding", (self.position_embedding,), _POSITIONS)
        _check_choices("remat_policy", (self.remat_policy,), _REMAT)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(
                f"DecoderConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even for rope, got {self.head_dim}")
        if self.rope_max_wavelength <= 0:
            raise ValueError(
                "DecoderConfig.rope_max_wavelength must be positive, "
                f"got {self.rope_max_wavelength}"
            )
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
            raise ValueError(
                "DecoderConfig.relative_attention_max_distance must exceed half "
                "of relative_attention_num_buckets "
                f"({self.relative_attention_num_buckets}), "
                f"got {self.relative_attention_max_distance}"
            )

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.dtype]


def _check_choices(field: str, values: tuple[str, ...], allowed) -> None:
    for value in values:
        if value not in allowed:
            raise ValueError(f"DecoderConfig.{field}: {value!r} is not one of {sorted(allowed)}")


def dropout(x: jnp.ndarray, rate: float, enable_dropout: bool, name: str | None = None):
    """T5X's dropout: one mask per position shared along axis -2 (length or query)."""
    return nn.Dropout(rate, broadcast_dims=(-2,), name=name)(x, deterministic=not enable_dropout)


class Dense(nn.Module):
    """A bias-free projection whose float32 kernel carries logical axes (T5X's DenseGeneral)."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype
    init_scale: float = 1.0
    distribution: str = "truncated_normal"

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        init = nn.initializers.variance_scaling(self.init_scale, "fan_in", self.distribution)
        kernel = param_with_axes(
            "kernel", init, (x.shape[-1], self.features), jnp.float32, axes=self.axes
        )
        # promote_dtype, Flax's own cast, so a quantized kernel (runtime/lora) stays quantized
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jnp.einsum("...d,df->...f", x, kernel)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias (T5's LayerNorm)."""

    dtype: jnp.dtype
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x_BxLxD: jnp.ndarray) -> jnp.ndarray:
        x = x_BxLxD.astype(jnp.float32)
        scale_D = param_with_axes(
            "scale", nn.initializers.ones, (x.shape[-1],), jnp.float32, axes=("embed",)
        )
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
        return (x * scale_D).astype(self.dtype)


class Embed(nn.Module):
    """Token embedding table; `attend` gives logits against it (tied embeddings)."""

    vocab_size: int
    emb_dim: int

    def setup(self) -> None:
        self.embedding = param_with_axes(
            "embedding",
            nn.initializers.normal(1.0),
            (self.vocab_size, self.emb_dim),
            jnp.float32,
            axes=("vocab", "embed"),
        )

    def __call__(self, tokens_BxL: jnp.ndarray) -> jnp.ndarray:
        return jnp.take(self.embedding, tokens_BxL.astype(jnp.int32), axis=0)

    def attend(self, x_BxLxD: jnp.ndarray) -> jnp.ndarray:
        return jnp.einsum("bld,vd->blv", x_BxLxD.astype(jnp.float32), self.embedding)


def relative_position_buckets(
    relative_BxLxS: jnp.ndarray, num_buckets: int, max_distance: int
) -> jnp.ndarray:
    """T5's causal bucketing of (key - query) positions: exact when near, log-spaced when far.

    Keys after the query (reachable only inside a prefix-LM prefix) share bucket 0 with the
    query itself, as in T5X's decoder, which always buckets unidirectionally.
    """
    distance = jnp.maximum(-relative_BxLxS, 0)
    exact = num_buckets // 2
    log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32)
    far = jnp.minimum(far, num_buckets - 1)
    return jnp.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """Per-head attention bias looked up from bucketed relative positions."""

    num_heads: int
    num_buckets: int
    max_distance: int

    @nn.compact
    def __call__(self, positions_BxL: jnp.ndarray) -> jnp.ndarray:
        table_HxN = param_with_axes(
            "rel_embedding",
            nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
            (self.num_heads, self.num_buckets),
            jnp.float32,
            axes=("heads", "relpos_buckets"),
        )
        relative_BxLxS = positions_BxL[:, None, :] - positions_BxL[:, :, None]
        buckets_BxLxS = relative_position_buckets(
            relative_BxLxS, self.num_buckets, self.max_distance
        )
        return jnp.moveaxis(table_HxN[:, buckets_BxLxS], 0, 1)  # [B, H, L, S]


def rotate(
    x_BxLxHxK: jnp.ndarray, positions_BxL: jnp.ndarray, max_wavelength: float
) -> jnp.ndarray:
    """Rotary position embedding of queries or keys (first half paired with second half)."""
    half = x_BxLxHxK.shape[-1] // 2
    inv_freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxLx1xK2 = positions_BxL[:, :, None, None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angle_BxLx1xK2), jnp.cos(angle_BxLx1xK2)
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout):
        c = self.config
        dtype, hk = c.compute_dtype, c.num_heads * c.head_dim

        def project(name: str, init_scale: float = 1.0) -> jnp.ndarray:
            kernel = Dense(hk, ("embed", "joined_kv"), dtype, init_scale, "normal", name=name)
            y_BxLxHK = kernel(x_BxLxD)
            y_BxLxHxK = y_BxLxHK.reshape(y_BxLxHK.shape[:2] + (c.num_heads, c.head_dim))
            return constrain(y_BxLxHxK, ("batch", "length", "heads", "kv"))

        # T5 scales logits by 1/sqrt(head_dim) through the query's initialisation instead.
        q_BxLxHxK = project("query", init_scale=1.0 / c.head_dim)
        k_BxSxHxK = project("key")
        v_BxSxHxK = project("value")
        if c.position_embedding == "rope":
            q_BxLxHxK = rotate(q_BxLxHxK, positions_BxL, c.rope_max_wavelength)
            k_BxSxHxK = rotate(k_BxSxHxK, positions_BxL, c.rope_max_wavelength)
        scores_BxHxLxS = jnp.einsum(
            "blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK, preferred_element_type=jnp.float32
        )
        if bias_BxHxLxS is not None:
            scores_BxHxLxS = scores_BxHxLxS + bias_BxHxLxS
        scores_BxHxLxS = jnp.where(mask_Bx1xLxS, scores_BxHxLxS, jnp.finfo(jnp.float32).min)
        probs_BxHxLxS = jax.nn.softmax(scores_BxHxLxS, axis=-1).astype(dtype)
        probs_BxHxLxS = dropout(probs_BxHxLxS, c.dropout_rate, enable_dropout)
        out_BxLxHxK = jnp.einsum("bhls,bshk->blhk", probs_BxHxLxS, v_BxSxHxK)
        out_BxLxHK = out_BxLxHxK.reshape(out_BxLxHxK.shape[:2] + (hk,))
        return Dense(c.emb_dim, ("joined_kv", "embed"), dtype, distribution="normal", name="out")(
            out_BxLxHK
        )


class Mlp(nn.Module):
    """Gated MLP: the product of one projection per activation, then `wo` (T5's names)."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BxLxD, enable_dropout):
        c = self.config
        h_BxLxF = None
        for i, act in enumerate(c.mlp_activations):
            name = "wi" if len(c.mlp_activations) == 1 else f"wi_{i}"
            branch = _ACTIVATIONS[act](
                Dense(c.mlp_dim, ("embed", "mlp"), c.compute_dtype, name=name)(x_BxLxD)
            )
            h_BxLxF = branch if h_BxLxF is None else h_BxLxF * branch
        h_BxLxF = dropout(h_BxLxF, c.dropout_rate, enable_dropout)
        h_BxLxF = constrain(h_BxLxF, ("batch", "length", "mlp"))
        return Dense(c.emb_dim, ("mlp", "embed"), c.compute_dtype, name="wo")(h_BxLxF)


class DecoderLayer(nn.Module):
    config: DecoderConfig

    def mlp_block(self, x_BxLxD, mask_Bx1xLxS, enable_dropout):
        """The feed-forward block (a hook: nets.moe replaces it with a mixture of experts)."""
        del mask_Bx1xLxS  # a dense MLP treats every position alike
        return Mlp(self.config, name="mlp")(x_BxLxD, enable_dropout)

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout):
        c = self.config
        h = RMSNorm(c.compute_dtype, name="pre_self_attention_layer_norm")(x_BxLxD)
        h = Attention(c, name="self_attention")(
            h, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout
        )
        x_BxLxD = x_BxLxD + dropout(
            h, c.dropout_rate, enable_dropout, "post_self_attention_dropout"
        )
        h = RMSNorm(c.compute_dtype, name="pre_mlp_layer_norm")(x_BxLxD)
        h = self.mlp_block(h, mask_Bx1xLxS, enable_dropout)
        x_BxLxD = x_BxLxD + dropout(h, c.dropout_rate, enable_dropout, "post_mlp_dropout")
        return constrain(x_BxLxD, ("batch", "length", "embed"))


def decoder_mask(target_tokens_BxL, segments_BxL=None, causal_attention_BxL=None) -> jnp.ndarray:
    """[B, 1, L, S] booleans, as T5X's make_decoder_mask: causal, or bidirectional between
    prefix positions; non-padding (target > 0) only; same segment only when packed."""
    length = target_tokens_BxL.shape[1]
    allowed_BxLxS = (jnp.arange(length)[:, None] >= jnp.arange(length)[None, :])[None]
    if causal_attention_BxL is not None:
        prefix_BxL = causal_attention_BxL.astype(bool)
        allowed_BxLxS = allowed_BxLxS | (prefix_BxL[:, :, None] & prefix_BxL[:, None, :])
    real_BxL = target_tokens_BxL > 0
    mask_BxLxS = allowed_BxLxS & real_BxL[:, :, None] & real_BxL[:, None, :]
    if segments_BxL is not None:
        mask_BxLxS = mask_BxLxS & (segments_BxL[:, :, None] == segments_BxL[:, None, :])
    return mask_BxLxS[:, None]


def remat_layer(layer_cls: type[nn.Module], policy: str) -> type[nn.Module]:
    """A layer class rematerialised by a named policy (the class itself for 'none')."""
    if _REMAT[policy] is None:
        return layer_cls
    # Argument 0 is the module itself, so 5 is `enable_dropout`, a Python bool.
    return nn.remat(layer_cls, policy=_REMAT[policy], prevent_cse=True, static_argnums=(5,))


# A layer class and its extra constructor arguments (hashable: module attributes).
LayerSpec = tuple[type[nn.Module], tuple[tuple[str, object], ...]]


class LayerBlock(nn.Module):
    """Consecutive layers, the unit `scan_layers` repeats; returns (x, None) for nn.scan."""

    config: DecoderConfig
    layers: tuple[LayerSpec, ...]
    enable_dropout: bool

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL):
        for j, (cls, kwargs) in enumerate(self.layers):
            x_BxLxD = cls(self.config, **dict(kwargs), name=f"layers_{j}")(
                x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, self.enable_dropout
            )
        return x_BxLxD, None


class Decoder(nn.Module):
    """The network: tokens in, float32 logits [batch, length, vocab] out."""

    config: DecoderConfig

    def layer_spec(self, i: int) -> LayerSpec:
        """Layer i's class (a hook: nets.MoeDecoder makes some layers sparse)."""
        return remat_layer(DecoderLayer, self.config.remat_policy), ()

    def block_size(self) -> int:
        """Layers per scanned block (the period of layer_spec)."""
        return 1

    def scanned_layers(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL,
                       enable_dropout):
        c, size = self.config, self.block_size()
        if c.num_layers % size:
            raise ValueError(f"DecoderConfig.scan_layers: num_layers={c.num_layers} is not a "
                             f"multiple of the scanned block of {size} layers")
        scanned = nn_partitioning.scan_with_axes(
            LayerBlock,
            variable_axes={"params": 0, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.num_layers // size,
            axis_name="layers",
        )
        block = tuple(self.layer_spec(j) for j in range(size))
        x_BxLxD, _ = scanned(c, block, enable_dropout, name="layers")(
            x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL
        )
        return x_BxLxD

    @nn.compact
    def __call__(
        self,
        decoder_input_tokens,
        decoder_target_tokens,
        decoder_segment_ids=None,
        decoder_positions=None,
        decoder_causal_attention=None,
        *,
        enable_dropout=True,
        decode=False,
        max_decode_length=None,
        prefill=None,
        prefill_lengths=None,
    ):
        del max_decode_length, prefill_lengths  # decoding only, which is not implemented
        if decode or prefill:
            raise NotImplementedError(
                "nets.Decoder: autoregressive decoding (decode=True or prefill) is not "
                "implemented yet: there is no key/value cache; use it for training and scoring"
            )
        c = self.config
        dtype, length = c.compute_dtype, decoder_input_tokens.shape[1]
        # Unpacked rows share one arange, so the relative bias is computed once, not per row.
        positions_BxL = jnp.arange(length)[None] if decoder_positions is None else decoder_positions
        mask_Bx1xLxS = decoder_mask(
            decoder_target_tokens, decoder_segment_ids, decoder_causal_attention
        )
        bias_BxHxLxS = None
        if c.position_embedding == "relative":
            bias_BxHxLxS = RelativePositionBias(
                c.num_heads,
                c.relative_attention_num_buckets,
                c.relative_attention_max_distance,
                name="relpos_bias",
            )(positions_BxL)

        embedder = Embed(c.vocab_size, c.emb_dim, name="token_embedder")
        x_BxLxD = constrain(
            embedder(decoder_input_tokens).astype(dtype), ("batch", "length", "embed")
        )
        x_BxLxD = dropout(x_BxLxD, c.dropout_rate, enable_dropout, "input_dropout")
        if c.scan_layers:
            x_BxLxD = self.scanned_layers(
                x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout
            )
        else:
            for i in range(c.num_layers):
                cls, kwargs = self.layer_spec(i)
                x_BxLxD = cls(c, **dict(kwargs), name=f"layers_{i}")(
                    x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout
                )
        x_BxLxD = RMSNorm(dtype, name="decoder_norm")(x_BxLxD)
        x_BxLxD = dropout(x_BxLxD, c.dropout_rate, enable_dropout, "output_dropout")

        # Logits in float32 for a stable softmax, as T5X's decoder-only network does.
        if c.logits_via_embedding:
            logits_BxLxV = embedder.attend(x_BxLxD) / jnp.sqrt(c.emb_dim)
        else:
            logits_BxLxV = Dense(
                c.vocab_size, ("embed", "vocab"), jnp.float32, name="logits_dense"
            )(x_BxLxD)
        return constrain(logits_BxLxV, ("batch", "length", "vocab"))
