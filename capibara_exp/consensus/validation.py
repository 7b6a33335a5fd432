"""Validation loss of parameter trees on fixed batches, with the run's own model loss.

Held-out batches come in two disjoint sets drawn from one pass over the validation
split: the selection set, which the gate, greedy soup and learned weights look at, and
the report set, which only the report sees, so the merged model's reported loss is not
measured on the batches that chose it.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Evaluator:
    """Mean per-token loss of `model` on fixed batches.

    The same batches score every candidate and the merge, so the numbers compare. Works
    with any model whose `loss_fn(params, batch, dropout_rng)` returns (summed loss, ...)
    (the local engine's and T5X's models without loss_normalizing_factor).
    """

    def __init__(self, model: Any, batches: list[dict]):
        if not batches:
            raise ValueError("evaluation needs at least one batch")
        self.model = model
        self.batches = batches
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


def held_out(model: Any, dataset_cfg: Any, selection_batches: int, report_batches: int
             ) -> tuple[Evaluator, Evaluator | None]:
    """(selection evaluator, report evaluator or None when report_batches is 0), on
    consecutive, disjoint batches of one pass over the data set."""
    from capibara_exp.runtime import inputs

    if selection_batches < 1 or report_batches < 0:
        raise ValueError(f"held-out batches: selection needs >= 1 and report >= 0, got "
                         f"{selection_batches} and {report_batches}")
    want = selection_batches + report_batches
    stream = inputs.batches(dataset_cfg, model.FEATURE_CONVERTER_CLS, dataset_cfg.seed,
                            repeat=False)
    got = list(itertools.islice(stream, want))
    if len(got) < want:
        raise ValueError(
            f"validation data {dataset_cfg.mixture_or_task_name!r} (split {dataset_cfg.split!r}) "
            f"has {len(got)} batches of {dataset_cfg.batch_size}; {selection_batches} selection + "
            f"{report_batches} report batches need {want}: lower them (report batches 0 reports "
            "on the selection batches, flagged in-sample)")
    report = Evaluator(model, got[selection_batches:]) if report_batches else None
    return Evaluator(model, got[:selection_batches]), report


def from_parts(parts: Any, selection_batches: int | None = None,
               report_batches: int | None = None) -> tuple[Evaluator, Evaluator | None]:
    """Selection and report evaluators on a run's train_eval data set: its eval_steps
    selection batches by default, and as many report batches as selection ones."""
    if parts.eval_dataset_cfg is None:
        raise ValueError("the run has no train_eval data set (train_eval_dataset_cfg = None): "
                         "merging needs validation batches to gate and report candidates")
    selection = max(parts.eval_steps, 1) if selection_batches is None else selection_batches
    return held_out(parts.model, parts.eval_dataset_cfg, selection,
                    selection if report_batches is None else report_batches)
