"""T5X's `models.DecoderOnlyModel` for the local engine: a module, a vocabulary, a loss."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import seqio
from flax import linen as nn
from flax.core import unfreeze

from capibara_exp.runtime.utils import reject_unsupported

Batch = dict[str, jnp.ndarray]

# The batch features of seqio.DecoderFeatureConverter that reach the module.
_MODULE_FEATURES = ("decoder_segment_ids", "decoder_positions")


def cross_entropy_with_z_loss(logits_BxLxV: jnp.ndarray, targets_BxL: jnp.ndarray,
                              label_smoothing: float, z_loss: float
                              ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token (total loss, z loss) as T5X defines them (label smoothing normalised)."""
    vocab = logits_BxLxV.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    normalizer = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    soft_BxLxV = jax.nn.one_hot(targets_BxL, vocab) * (confidence - low) + low
    log_z_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    log_softmax_BxLxV = logits_BxLxV - log_z_BxL[..., None]
    xent_BxL = -jnp.sum(soft_BxLxV * log_softmax_BxLxV, axis=-1) - normalizer
    z_BxL = z_loss * jnp.square(log_z_BxL)
    return xent_BxL + z_BxL, z_BxL


def _init_program(module: Any, batch_size: int, length: int) -> Callable[[jax.Array], Any]:
    def init(rng: jax.Array) -> Any:
        tokens = jnp.ones((batch_size, length), jnp.int32)
        return module.init({"params": rng, "dropout": rng}, tokens, tokens, tokens,
                           jnp.broadcast_to(jnp.arange(length), tokens.shape),
                           enable_dropout=False)

    return jax.jit(init)


_cached_init_program = functools.lru_cache(maxsize=8)(_init_program)


def _initializer(module: Any, batch_size: int, length: int) -> Callable[[jax.Array], Any]:
    """The jitted init of a module; kept per (module, shape), so runs in one process (a
    sweep's trials) with equal networks trace and compile it once. Flax modules compare and
    hash by their fields."""
    try:
        hash(module)
    except TypeError:  # a field that does not hash: no sharing
        return _init_program(module, batch_size, length)
    return _cached_init_program(module, batch_size, length)


class DecoderOnlyModel:
    """A decoder-only LM; `loss_fn` sums token losses unless loss_normalizing_factor is set."""

    FEATURE_CONVERTER_CLS = seqio.DecoderFeatureConverter

    def __init__(
        self,
        module: nn.Module,
        vocabulary: seqio.Vocabulary,
        optimizer_def: Any,
        decode_fn: Any = None,
        inputs_bidirectional_attention: bool = False,
        feature_converter_cls: Any = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        loss_normalizing_factor: float | None = None,
    ):
        reject_unsupported("models.DecoderOnlyModel", feature_converter_cls=feature_converter_cls)
        factor = loss_normalizing_factor
        if factor is not None and not isinstance(factor, (int, float)):
            raise ValueError("models.DecoderOnlyModel.loss_normalizing_factor: the local engine "
                             f"takes a number or None, got {factor!r}")
        self.module = module
        self.decode_fn = decode_fn  # T5X's decoding function of the inference eval
        self.vocabulary = vocabulary
        self.optimizer_def = optimizer_def
        self.inputs_bidirectional_attention = inputs_bidirectional_attention
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.loss_normalizing_factor = loss_normalizing_factor

    def get_initial_variables(self, rng: jax.Array, batch_size: int, length: int) -> dict:
        """Initial 'params' and 'params_axes' for inputs of [batch_size, length], computed as
        one compiled program, as T5X does (op by op, even a small model spends seconds
        compiling each op)."""
        return unfreeze(_initializer(self.module, batch_size, length)(rng))

    def _compute_logits(self, params: Any, batch: Batch, dropout_rng: jax.Array | None,
                        mutable: Any = False) -> Any:
        """Logits, or (logits, mutated collections) when `mutable` names any (T5X's method)."""
        features = {k: batch[k] for k in _MODULE_FEATURES if k in batch}
        if self.inputs_bidirectional_attention:
            features["decoder_causal_attention"] = batch["decoder_causal_attention"]
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
        return self.module.apply({"params": params}, batch["decoder_input_tokens"],
                                 batch["decoder_target_tokens"], **features,
                                 enable_dropout=dropout_rng is not None, rngs=rngs,
                                 mutable=mutable)

    def logits(self, params: Any, batch: Batch, dropout_rng: jax.Array | None) -> jnp.ndarray:
        return self._compute_logits(params, batch, dropout_rng)

    def loss_fn(self, params: Any, batch: Batch, dropout_rng: jax.Array | None
                ) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
        """(loss to differentiate, metric sums over the batch's real tokens)."""
        return self.token_loss(self.logits(params, batch, dropout_rng), batch)

    def token_loss(self, logits_BxLxV: jnp.ndarray, batch: Batch
                   ) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
        """The language-model loss of given logits and its metric sums."""
        logits_BxLxV = logits_BxLxV.astype(jnp.float32)
        targets_BxL = batch["decoder_target_tokens"]
        weights_BxL = batch.get("decoder_loss_weights", targets_BxL > 0).astype(jnp.float32)
        loss_BxL, z_BxL = cross_entropy_with_z_loss(logits_BxLxV, targets_BxL,
                                                    self.label_smoothing, self.z_loss)
        loss = jnp.sum(loss_BxL * weights_BxL)
        if self.loss_normalizing_factor is not None:
            loss = loss / self.loss_normalizing_factor
        correct_BxL = (jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32)
        z_sum = jnp.sum(z_BxL * weights_BxL)
        sums = {
            "loss_sum": jnp.sum(loss_BxL * weights_BxL),
            "z_loss_sum": z_sum,
            "cross_ent_sum": jnp.sum(loss_BxL * weights_BxL) - z_sum,
            "correct_sum": jnp.sum(correct_BxL * weights_BxL),
            "weight_sum": jnp.sum(weights_BxL),
        }
        return loss, sums
