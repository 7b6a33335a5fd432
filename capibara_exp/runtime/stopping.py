"""Stop sequences that end decoding early, through T5X's own hook: `temperature_sample`'s
`state_callback_fn` runs before each step, and a row it marks `ended` emits only padding
from then on, and the loop ends once every row has ended (T5X's condition). A row ends when
its generated tokens end with any stop sequence (one token or several); EOS stays T5X's.
So a batch whose rows have all stopped costs one step more than its longest output, not
`max_new_tokens` steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp


def stop_callback(stops: Sequence[Sequence[int]], initial_index: Any, num_decodes: int) -> Any:
    """A `state_callback_fn` ending rows whose last generated tokens equal a stop sequence.
    `initial_index` is T5X's [batch] index of each prompt's last token (the decode starts
    there), so only tokens after it, the generated ones, can match."""
    from t5x import decoding

    if initial_index is None:  # no prefill: every position after BOS 0 is generated
        first = None
    else:  # [batch * num_decodes], as temperature_sample expands the batch
        first = decoding.flat_batch_beam_expand(initial_index, num_decodes) \
            if num_decodes > 1 else initial_index
    stops = [tuple(int(t) for t in s) for s in stops if len(s)]

    def callback(state: Any) -> Any:
        i = state.cur_index  # [rows]: position of the token just written (cur_token)
        hit = jnp.zeros(i.shape, bool)
        for stop in stops:
            back = jnp.arange(len(stop) - 1, -1, -1)  # offsets of the stop's tokens from i
            pos = i[:, None] - back[None, :]
            tokens = jnp.take_along_axis(state.sequences, jnp.maximum(pos, 0), axis=1)
            generated = pos[:, 0] > (0 if first is None else first)
            hit = hit | (jnp.all(tokens == jnp.asarray(stop)[None, :], axis=1) & generated)
        return state.replace(ended=state.ended | hit[:, None])

    return callback


def with_stops(sample_fn: Any, stops: Sequence[Sequence[int]]) -> Any:
    """`sample_fn` (a temperature_sample) with the stop callback built per call (it needs
    the call's initial_index and num_decodes); no stops: `sample_fn` itself."""
    if not any(len(s) for s in stops):
        return sample_fn

    def decode(*, initial_index: Any = None, num_decodes: int = 1, **kwargs: Any) -> Any:
        return sample_fn(initial_index=initial_index, num_decodes=num_decodes,
                         state_callback_fn=stop_callback(stops, initial_index, num_decodes),
                         **kwargs)

    return decode


def cut(ids: Sequence[int], stops: Sequence[Sequence[int]]) -> list[int]:
    """Generated ids up to (without) the first complete stop sequence, or padding 0."""
    out: list[int] = []
    for t in ids:
        if t == 0:
            break
        out.append(int(t))
        for stop in stops:
            if len(stop) and out[-len(stop):] == list(stop):
                return out[:-len(stop)]
    return out
