"""Validation loss of parameter trees on fixed batches, with the run's own model loss."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Evaluator:
    """Mean per-token loss of `model` on `num_batches` fixed batches of a data set.

    The same batches score every candidate and the merge, so the numbers compare. Works
    with any model whose `loss_fn(params, batch, dropout_rng)` returns (summed loss, ...)
    (the local engine's and T5X's models without loss_normalizing_factor).
    """

    def __init__(self, model: Any, dataset_cfg: Any, num_batches: int):
        from capibara_exp.runtime import inputs

        if num_batches < 1:
            raise ValueError(f"evaluation needs at least one batch, got num_batches={num_batches}")
        self.model = model
        it = inputs.batches(dataset_cfg, model.FEATURE_CONVERTER_CLS, dataset_cfg.seed, repeat=True)
        self.batches = [next(it) for _ in range(num_batches)]
        self.tokens = float(sum(np.sum(b["decoder_loss_weights"]) for b in self.batches))
        self._loss = jax.jit(self._total_loss)
        self._loss_and_grad = jax.jit(jax.value_and_grad(self._total_loss))

    def _total_loss(self, params: Any) -> jnp.ndarray:
        total = jnp.zeros((), jnp.float32)
        for batch in self.batches:
            total = total + self.model.loss_fn(params, batch, None)[0]
        return total / self.tokens

    def loss(self, params: Any) -> float:
        """Mean validation loss per real token (inf if it is not finite)."""
        value = float(self._loss(params))
        return value if np.isfinite(value) else float("inf")

    def loss_and_grad(self, params: Any) -> tuple[float, Any]:
        value, grads = self._loss_and_grad(params)
        return float(value), grads


def from_parts(parts: Any, num_batches: int | None = None) -> Evaluator:
    """An evaluator on a run's train_eval data set (its eval_steps batches by default)."""
    if parts.eval_dataset_cfg is None:
        raise ValueError("the run has no train_eval data set (train_eval_dataset_cfg = None): "
                         "merging needs validation batches to gate and report candidates")
    return Evaluator(parts.model, parts.eval_dataset_cfg, num_batches or max(parts.eval_steps, 1))
