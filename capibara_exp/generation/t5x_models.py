"""T5X's model classes as engine=t5x binds them: gin_bridge's t5x header imports this module
as `models` and t5x_moe_models as `moe_models`, so `models.DecoderOnlyModel` in config.gin
is T5X's class with one change, and every other `models.<name>` is T5X's own.

The change: T5X's InferenceEvaluator calls `predict_batch(params, batch, rng)`, which decodes
one sequence per example. These classes take the number of samples from their `decode_fn`
(generation/infer_sampling.InferSampling.num_samples, bound by gin/runs/infer_eval.gin) and
ask T5X's own `predict_batch_with_aux` for that many (`num_decodes`, `return_all_decodes`):
predictions are then [batch, samples, length], which seqio decodes as a list of samples per
example, and the codegen metric scores each. A decode_fn without `num_samples` (T5X's
default temperature_sample) keeps T5X's behaviour exactly: one decode, the best."""

from __future__ import annotations

from typing import Any

from t5x import models as _t5x_models


def samples_of(decode_fn: Any) -> int:
    """How many samples per example `decode_fn` asks for (1 unless it says)."""
    return int(getattr(decode_fn, "num_samples", 1) or 1)


class DrawsSamples:
    """Mixin before a T5X decoder-only model class: predict_batch_with_aux's num_decodes
    and return_all_decodes default to the decode_fn's sample count."""

    def predict_batch_with_aux(self, params: Any, batch: Any, rng: Any = None, *,
                               return_all_decodes: bool | None = None,
                               num_decodes: int | None = None,
                               decoder_params: Any = None) -> Any:
        n = samples_of(self._decode_fn)
        return super().predict_batch_with_aux(
            params, batch, rng,
            return_all_decodes=n > 1 if return_all_decodes is None else return_all_decodes,
            num_decodes=n if num_decodes is None else num_decodes,
            decoder_params=decoder_params)


class DecoderOnlyModel(DrawsSamples, _t5x_models.DecoderOnlyModel):
    """t5x.models.DecoderOnlyModel drawing the decode_fn's samples per example."""


def __getattr__(name: str) -> Any:
    """Every other name is t5x.models' (a user's gin file may bind any of them)."""
    return getattr(_t5x_models, name)
