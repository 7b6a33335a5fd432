"""Decoding with T5X's own prediction path: `t5x.models.DecoderOnlyModel.predict_batch_with_aux`
around the project's network (its `decode=True` cache, the prompt prefilled in one pass),
with `t5x.decoding.temperature_sample` (greedy = temperature 0, temperature, top-k, top-p) or
`t5x.decoding.beam_search` as its decode_fn. So the local engine decodes exactly as T5X's
predict_batch and t5x.infer do.

Prompts follow seqio.DecoderFeatureConverter's layout for inputs-only prediction: the
decoder input is [0, p1 .. pn, 0 ...] (0 is T5X's BOS) and `decoder_causal_attention` marks
the n + 1 prompt positions; T5X returns the generated tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capibara_exp.runtime import stopping

METHODS = ("greedy", "sample", "beam")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to decode. top_k=0 and top_p=0 switch those filters off; num_samples decodes per
    prompt (sampling: independent samples; beam: the best beams, best first)."""

    method: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    num_beams: int = 4
    alpha: float = 0.6  # beam search's length penalty (T5X's brevity exponent)
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # several tokens each
    seed: int = 0
    num_samples: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: one of {', '.join(METHODS)}")
        for name in ("max_new_tokens", "num_samples", "num_beams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 <= self.top_p <= 1:
            raise ValueError("temperature and top_k must be >= 0, top_p in [0, 1]")
        if self.method == "beam" and self.num_samples > self.num_beams:
            raise ValueError(f"num_samples={self.num_samples} > num_beams={self.num_beams}")

    @property
    def num_decodes(self) -> int:
        return self.num_beams if self.method == "beam" else self.num_samples

    @property
    def stops(self) -> tuple[tuple[int, ...], ...]:
        """Every stop as a token sequence (a stop token is one of one token)."""
        return tuple((int(t),) for t in self.stop_tokens) + tuple(
            tuple(int(t) for t in seq) for seq in self.stop_sequences if len(seq))


def decode_fn(s: Sampling) -> Any:
    """The t5x.decoding function and its fixed arguments. Sampling and greedy decoding end
    once every row has emitted EOS or a stop (runtime/stopping.py); beam search ends at
    EOS or max length, its stops cut afterwards."""
    from t5x import decoding

    if s.method == "beam":
        return functools.partial(decoding.beam_search, alpha=s.alpha)
    if s.method == "greedy" or s.temperature == 0:  # T5X's zero-temperature branch: argmax
        sample = functools.partial(decoding.temperature_sample, temperature=0.0, topk=0,
                                   max_decode_steps=s.max_new_tokens)
    else:
        sample = functools.partial(decoding.temperature_sample, temperature=s.temperature,
                                   topk=s.top_k, topp=s.top_p,
                                   max_decode_steps=s.max_new_tokens)
    return stopping.with_stops(sample, s.stops)


def t5x_model(module: Any, vocabulary: Any, s: Sampling) -> Any:
    """T5X's DecoderOnlyModel around the network (no optimizer: it only predicts)."""
    from t5x import models

    return models.DecoderOnlyModel(module, vocabulary, optimizer_def=None,
                                   decode_fn=decode_fn(s))


def prompt_batch(prompts: Sequence[Sequence[int]], length: int) -> dict[str, np.ndarray]:
    """DecoderFeatureConverter's features of inputs-only examples, padded to `length`."""
    tokens = np.zeros((len(prompts), length), np.int32)
    causal = np.zeros((len(prompts), length), np.int32)
    for row, ids in enumerate(prompts):
        tokens[row, 1:len(ids) + 1] = ids
        causal[row, :len(ids) + 1] = 1
    return {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
            "decoder_causal_attention": causal}


def predict_program(model: Any, s: Sampling) -> Any:
    def predict(params, batch, rng):
        decodes, aux = model.predict_batch_with_aux(
            params, batch, rng=None if s.method == "beam" else rng,
            num_decodes=s.num_decodes, return_all_decodes=True)
        return decodes, aux["scores"]

    return jax.jit(predict)


def generate(module: Any, params: Any, vocabulary: Any, prompts: Sequence[Sequence[int]],
             s: Sampling, batch_size: int = 8, on_compiled: Any = None
             ) -> Iterator[list[tuple[list[int], float]]]:
    """For each prompt (token ids, at least one), its decodes as (generated ids, score),
    best first for beam search; batches of `batch_size` prompts, one compiled program
    (compiled before the first batch; `on_compiled()` is called then, so rates can leave
    the compile out)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt (T5X's decoding needs at least one token)")
    model = t5x_model(module, vocabulary, s)
    program = predict_program(model, s)
    batch_size = min(batch_size, len(prompts))  # no rows decoded for nothing
    width = max(len(p) for p in prompts)
    length = width + 1 + s.max_new_tokens
    stops = ((vocabulary.eos_id,), *s.stops)
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        real = len(chunk)
        chunk += [chunk[0]] * (batch_size - real)  # one shape: one compile
        batch = {k: jnp.asarray(v) for k, v in prompt_batch(chunk, length).items()}
        rng = jax.random.fold_in(jax.random.PRNGKey(s.seed), start)
        if start == 0:
            program = program.lower(params, batch, rng).compile()
            if on_compiled:
                on_compiled()
        decodes, scores = jax.device_get(program(params, batch, rng))
        for row in range(real):
            yield _row(decodes[row], scores[row], s, stops)


def _row(decodes_NxL, scores_N, s: Sampling, stops) -> list:
    """One prompt's decodes, best first (T5X sorts them by increasing score)."""
    order = np.argsort(-np.asarray(scores_N), kind="stable")[:s.num_samples]
    if s.method == "sample":  # independent samples: keep their order
        order = np.arange(s.num_samples)
    # T5X's decoders return the generated tokens alone (the prompt dropped); beam search
    # may run past max_new_tokens for a row with a short prompt: cut there.
    return [(stopping.cut(decodes_NxL[i][:s.max_new_tokens], stops), float(scores_N[i]))
            for i in order]
