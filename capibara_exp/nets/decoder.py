"""The decoder-only Transformer of every model family, with T5X's decoder call signature and
logical axes.

Blocks of norm -> causal self-attention and norm -> gated MLP, pre-norm (T5, Llama, Mistral,
Qwen) or with norms on the block outputs too (Gemma 2/3). Positions are T5's relative bias
(one table shared by all layers) or rotary embeddings; attention may use grouped key/value
heads, a sliding window in local layers, QK-norm and soft-capped scores (nets/attention.py,
nets/config.py list the options). Packing through segment ids and positions, prefix-LM
through `decoder_causal_attention`, and T5X's incremental decoding (`decode`, `prefill`:
the 'cache' collection). Parameters are float32, named as in T5X's decoder-only example
(`layers_0/self_attention/query/kernel`, ...) with its logical axis names in 'params_axes',
so `models.DecoderOnlyModel.module = @nets.Decoder()` works in real T5X and the local runtime.

Shape suffixes: B batch, L query length, S key length, D embed, H heads, K head dim,
F mlp, V vocab, N relative-position buckets.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

from capibara_exp.base import logical_axes as axes
from capibara_exp.nets.attention import Attention
from capibara_exp.nets.config import DecoderConfig as DecoderConfig

# nets.moe builds its experts from these; `X as X` marks them as re-exported here.
from capibara_exp.nets.layers import ACTIVATIONS as _ACTIVATIONS
from capibara_exp.nets.layers import Dense as Dense
from capibara_exp.nets.layers import Embed, RMSNorm, dropout, softcap
from capibara_exp.nets.layers import constrain as constrain
from capibara_exp.nets.layers import param_with_axes as param_with_axes
from capibara_exp.nets.positions import RelativePositionBias
from capibara_exp.nets.remat import checkpoint_name
from capibara_exp.nets.remat import remat_layer as remat_layer
from capibara_exp.nets.splash import splash_segments


class Mlp(nn.Module):
    """Gated MLP: the product of one projection per activation, then `wo` (T5's names)."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BxLxD, enable_dropout):
        c = self.config
        h_BxLxF = None
        for i, act in enumerate(c.mlp_activations):
            name = "wi" if len(c.mlp_activations) == 1 else f"wi_{i}"
            branch = _ACTIVATIONS[act](checkpoint_name(
                Dense(c.mlp_dim, ("embed", "mlp"), c.compute_dtype, name=name)(x_BxLxD),
                "mlpwi"))
            h_BxLxF = branch if h_BxLxF is None else h_BxLxF * branch
        h_BxLxF = dropout(h_BxLxF, c.dropout_rate, enable_dropout)
        h_BxLxF = constrain(h_BxLxF, axes.HIDDEN)
        return checkpoint_name(
            Dense(c.emb_dim, ("mlp", "embed"), c.compute_dtype, name="wo")(h_BxLxF), "mlpwo")


def norm(c: DecoderConfig, name: str) -> RMSNorm:
    return RMSNorm(c.compute_dtype, c.norm_epsilon, c.norm_scale_plus_one, name=name)


class DecoderLayer(nn.Module):
    config: DecoderConfig
    local: bool = False  # attends through the sliding window
    decode: bool = False
    prefill: bool = False

    def mlp_block(self, x_BxLxD, real_BxL, enable_dropout):
        """The feed-forward block (a hook: nets.moe replaces it with a mixture of experts)."""
        del real_BxL  # a dense MLP treats every position alike
        return Mlp(self.config, name="mlp")(x_BxLxD, enable_dropout)

    def residual(self, x_BxLxD, h_BxLxD, name: str, enable_dropout: bool):
        """x + the block's output (normed first with norm_placement='pre_post')."""
        c = self.config
        if c.norm_placement == "pre_post":
            h_BxLxD = norm(c, f"post_{name}_layer_norm")(h_BxLxD)
        return x_BxLxD + dropout(h_BxLxD, c.dropout_rate, enable_dropout, f"post_{name}_dropout")

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout,
                 segments_BxL=None, real_BxL=None, prefill_lengths=None):
        """segments_BxL: what attention='splash' masks by (nets.splash.segments_for_splash);
        real_BxL: non-padding positions (a MoE block routes only those)."""
        c = self.config
        x_BxLxD = checkpoint_name(x_BxLxD, "decoder_layer_input")
        h = norm(c, "pre_self_attention_layer_norm")(x_BxLxD)
        h = Attention(c, self.local, name="self_attention")(
            h, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, enable_dropout, segments_BxL,
            decode=self.decode, prefill=self.prefill, prefill_lengths=prefill_lengths)
        x_BxLxD = self.residual(x_BxLxD, h, "self_attention", enable_dropout)
        h = norm(c, "pre_mlp_layer_norm")(x_BxLxD)
        h = self.mlp_block(h, real_BxL, enable_dropout)
        x_BxLxD = self.residual(x_BxLxD, h, "mlp", enable_dropout)
        return constrain(x_BxLxD, axes.RESIDUAL)


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


# A layer class and its extra constructor arguments (hashable: module attributes).
LayerSpec = tuple[type[nn.Module], tuple[tuple[str, object], ...]]


class LayerBlock(nn.Module):
    """Consecutive layers, the unit `scan_layers` repeats; returns (x, None) for nn.scan."""

    config: DecoderConfig
    layers: tuple[LayerSpec, ...]
    enable_dropout: bool

    @nn.compact
    def __call__(self, x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, segments_BxL,
                 real_BxL, prefill_lengths):
        for j, (cls, kwargs) in enumerate(self.layers):
            x_BxLxD = cls(self.config, **dict(kwargs), name=f"layers_{j}")(
                x_BxLxD, mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, self.enable_dropout,
                segments_BxL, real_BxL, prefill_lengths
            )
        return x_BxLxD, None


class Decoder(nn.Module):
    """The network: tokens in, float32 logits [batch, length, vocab] out."""

    config: DecoderConfig

    @property
    def scan_layers(self) -> bool:
        """T5X's predict_batch reads this (a scanned cache has a leading layers axis)."""
        return self.config.scan_layers

    def layer_spec(self, i: int, decode: bool = False, prefill: bool = False) -> LayerSpec:
        """Layer i's class and arguments (a hook: nets.MoeDecoder makes some layers sparse)."""
        return remat_layer(DecoderLayer, self.config), self.layer_kwargs(
            i, decode, prefill)

    def layer_kwargs(self, i: int, decode: bool, prefill: bool) -> tuple:
        return (("local", self.config.is_local(i)), ("decode", decode), ("prefill", prefill))

    def block_size(self) -> int:
        """Layers per scanned block (the period of layer_spec)."""
        return self.config.layer_period

    def run_layers(self, x_BxLxD, inputs: tuple, enable_dropout: bool, decode: bool,
                   prefill: bool):
        """The layers: whole blocks scanned (scan_layers), the rest unrolled (layers_<i>)."""
        c, size = self.config, self.block_size()
        blocks = c.num_layers // size if c.scan_layers else 0
        if blocks:
            scanned = nn_partitioning.scan_with_axes(
                LayerBlock,
                variable_axes={"params": 0, "intermediates": 0, "cache": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,) * 6,
                length=blocks,
                axis_name="layers",
                axes_collections=("params", "cache"),
            )
            block = tuple(self.layer_spec(j, decode, prefill) for j in range(size))
            x_BxLxD, _ = scanned(c, block, enable_dropout, name="layers")(x_BxLxD, *inputs)
        for i in range(blocks * size, c.num_layers):
            cls, kwargs = self.layer_spec(i, decode, prefill)
            x_BxLxD = cls(c, **dict(kwargs), name=f"layers_{i}")(
                x_BxLxD, *inputs[:3], enable_dropout, *inputs[3:])
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
        c = self.config
        dtype, length = c.compute_dtype, decoder_input_tokens.shape[1]
        prefill = bool(prefill)
        # A decode call after the one that made the cache (T5X's init) is one token's step.
        step = bool(decode) and not prefill and bool(self.variables.get("cache"))
        # Unpacked rows share one arange, so the relative bias is computed once, not per row.
        positions_BxL = jnp.arange(length)[None] if decoder_positions is None else decoder_positions
        if step:  # one token per row; attention builds its mask from the cache
            mask_Bx1xLxS = jnp.ones((decoder_input_tokens.shape[0], 1, 1, 1), bool)
        else:
            mask_Bx1xLxS = decoder_mask(
                decoder_target_tokens, decoder_segment_ids, decoder_causal_attention)
        bias_BxHxLxS = None
        if c.position_embedding == "relative":
            if step and not max_decode_length:
                raise ValueError("nets.Decoder: a decoding step of a relative-position model "
                                 "needs max_decode_length (the cache's length)")
            bias_positions = jnp.arange(max_decode_length)[None] if step else positions_BxL
            bias_BxHxLxS = RelativePositionBias(
                c.num_heads, c.relative_attention_num_buckets,
                c.relative_attention_max_distance, name="relpos_bias")(bias_positions)

        embedder = Embed(c.vocab_size, c.emb_dim, name="token_embedder")
        x_BxLxD = embedder(decoder_input_tokens).astype(dtype)
        if c.scale_embeddings:
            x_BxLxD = x_BxLxD * jnp.asarray(c.emb_dim ** 0.5, dtype)
        x_BxLxD = constrain(x_BxLxD, axes.RESIDUAL)
        x_BxLxD = dropout(x_BxLxD, c.dropout_rate, enable_dropout, "input_dropout")
        segments_BxL = splash_segments(c.attention, decoder_target_tokens, decoder_segment_ids,
                                       decoder_causal_attention)
        real_BxL = decoder_target_tokens > 0
        inputs = (mask_Bx1xLxS, bias_BxHxLxS, positions_BxL, segments_BxL, real_BxL,
                  prefill_lengths)
        x_BxLxD = self.run_layers(x_BxLxD, inputs, enable_dropout, bool(decode), prefill)
        x_BxLxD = norm(c, "decoder_norm")(x_BxLxD)
        x_BxLxD = dropout(x_BxLxD, c.dropout_rate, enable_dropout, "output_dropout")
        return self.logits(x_BxLxD, embedder)

    def logits(self, x_BxLxD, embedder: Embed):
        """Float32 logits for a stable softmax, as T5X's decoder-only network computes them."""
        c = self.config
        if c.logits_via_embedding:
            logits_BxLxV = embedder.attend(x_BxLxD)
            if c.normalize_embedding_logits:
                logits_BxLxV = logits_BxLxV / jnp.sqrt(c.emb_dim)
        else:
            logits_BxLxV = Dense(
                c.vocab_size, ("embed", "vocab"), jnp.float32, name="logits_dense"
            )(x_BxLxD)
        logits_BxLxV = softcap(logits_BxLxV, c.final_logit_softcap)
        return constrain(logits_BxLxV, axes.LOGITS)
