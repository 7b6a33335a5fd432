"""The inference eval's decoding as one T5X `decode_fn`: `t5x.decoding.temperature_sample`
at the configured temperature and top-p (temperature 0: T5X's argmax branch, greedy), and
the number of samples to draw per example, which predict_batch_with_aux is asked for
(num_decodes, return_all_decodes). Bound by gin/runs/infer_eval.gin as both model classes'
`decode_fn` from conf/infer_eval's keys, so both engines decode alike: the local engine's
inference eval reads `num_samples` itself; under engine=t5x the model classes of
generation/t5x_models.py read it when T5X's InferenceEvaluator calls predict_batch."""

from __future__ import annotations

from typing import Any


class InferSampling:
    def __init__(self, num_samples: int = 1, temperature: float = 0.0, top_p: float = 0.0):
        if num_samples < 1 or temperature < 0 or not 0 <= top_p <= 1:
            raise ValueError(f"InferSampling(num_samples={num_samples}, temperature="
                             f"{temperature}, top_p={top_p}): num_samples >= 1, temperature "
                             ">= 0, top_p in [0, 1]")
        self.num_samples = num_samples
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    def __call__(self, **kwargs: Any) -> Any:
        """T5X's decode_fn protocol (inputs, cache, tokens_to_logits, eos_id, decode_rng,
        num_decodes, initial_index, ... as keywords)."""
        from t5x import decoding

        return decoding.temperature_sample(temperature=self.temperature, topk=0,
                                           topp=self.top_p, **kwargs)

    def __repr__(self) -> str:
        return (f"InferSampling(num_samples={self.num_samples}, "
                f"temperature={self.temperature}, top_p={self.top_p})")
