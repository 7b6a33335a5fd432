"""Incremental decoding: every family's network, fed its prompt in one prefill and then one
token a step through T5X's `cache` collection, computes the logits of a full forward (f32);
greedy decoding of an imported tiny reference model is transformers' greedy generate; the
decoding settings do what they say."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from capibara_exp.convert.hf_export import compose_entry
from capibara_exp.convert.network import network
from capibara_exp.runtime import decoding

ENTRIES = ["dense_tiny", "moe_tiny", "llama3_tiny", "mistral_tiny", "qwen2_5_tiny",
           "qwen3_tiny", "gemma2_tiny", "gemma3_tiny", "mixtral_tiny", "qwen3_moe_tiny"]
TOLERANCE = 1e-4  # float32, max abs difference of logits (test_open_models.py's)
LENGTH, PROMPT = 12, 5


def tiny(entry: str, **overrides):
    keys = {**compose_entry(entry), "dtype": "float32", **overrides}
    if keys.get("num_experts") and not keys.get("dropless"):
        # Capacity routing drops by how many tokens share a group, which differs between a
        # full sequence and one token a step; with room for every token nothing is dropped.
        keys["eval_capacity_factor"] = float(keys["num_experts"])
    if keys.get("sliding_window"):
        keys["sliding_window"] = 4  # shorter than the sequence: the window bites
    net = network(keys)
    tokens = jnp.ones((2, LENGTH), jnp.int32)
    params = net.init(jax.random.PRNGKey(1), tokens, tokens, enable_dropout=False)["params"]
    return keys, net, params


def stepwise_logits(net, params, tokens_BxL: jnp.ndarray, prompt: int) -> jnp.ndarray:
    """T5X's predict path by hand: the cache made (decode=True), the prompt prefilled in one
    call, then one token a call; the logits at every position after the prompt's."""
    length = tokens_BxL.shape[1]
    ones = jnp.ones_like(tokens_BxL)
    _, made = net.apply({"params": params}, ones, ones, enable_dropout=False, decode=True,
                        mutable=["cache"])
    causal = (jnp.arange(length)[None] < prompt).astype(jnp.int32) * ones
    prompt_in = tokens_BxL * causal
    prefill_logits, filled = net.apply(
        {"params": params, "cache": made["cache"]}, prompt_in, causal,
        enable_dropout=False, decode=True, prefill=True,
        prefill_lengths=jnp.full((tokens_BxL.shape[0],), prompt), mutable=["cache"])
    cache, out = filled["cache"], [prefill_logits[:, :prompt]]
    step = jax.jit(lambda c, t: net.apply({"params": params, "cache": c}, t, t,
                                          enable_dropout=False, decode=True,
                                          max_decode_length=length, mutable=["cache"]))
    for i in range(prompt, length):
        logits, new = step(cache, tokens_BxL[:, i:i + 1])
        cache = new["cache"]
        out.append(logits)
    return jnp.concatenate(out, axis=1)


def full_logits(net, params, tokens_BxL):
    return net.apply({"params": params}, tokens_BxL, tokens_BxL, enable_dropout=False)


@pytest.mark.parametrize("entry", ENTRIES)
def test_stepwise_decode_equals_full_forward(entry: str) -> None:
    keys, net, params = tiny(entry)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, LENGTH), 3, keys["vocab_size"])
    want = np.asarray(full_logits(net, params, tokens))
    got = np.asarray(stepwise_logits(net, params, tokens, PROMPT))
    assert np.std(want) > 1e-3, "flat logits: the comparison could not fail"
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOLERANCE, f"{entry}: decoded logits differ from the forward's by {diff:.2e}"


@pytest.mark.parametrize("entry", ["gemma3_tiny", "qwen3_moe_tiny", "dense_tiny"])
def test_stepwise_decode_with_scanned_layers(entry: str) -> None:
    keys, net, params = tiny(entry, scan_layers=True)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, LENGTH), 3, keys["vocab_size"])
    want = np.asarray(full_logits(net, params, tokens))
    got = np.asarray(stepwise_logits(net, params, tokens, PROMPT))
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


def hf_greedy(hf_dir: Path, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy generate; T5X's decoder sees the prompt after its BOS 0, so
    the reference is given the same tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval().float()
    ids = torch.tensor([[0, *prompt]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             num_beams=1, max_new_tokens=new_tokens, eos_token_id=eos,
                             pad_token_id=0, min_new_tokens=0)
    got = [int(t) for t in out[0, ids.shape[1]:]]
    return got[:got.index(eos)] if eos in got else got


@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma2", "qwen3_moe"])
def test_greedy_decoding_equals_transformers_generate(family: str, tmp_path: Path) -> None:
    from capibara_exp.convert import hf_import
    from capibara_exp.generation import loading
    from tests import hf_reference

    hf_dir = hf_reference.build_model(family, tmp_path / "hf")
    hf_import.import_model(hf_dir, tmp_path / "out", name="m")
    loaded = loading.load(tmp_path / "out")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 300, n)) for n in (3, 7)]
    s = decoding.Sampling(max_new_tokens=10)
    eos = loaded.vocabulary.eos_id
    got = [d[0][0] for d in decoding.generate(loaded.module, loaded.params, loaded.vocabulary,
                                              prompts, s, batch_size=2)]
    want = [hf_greedy(hf_dir, p, 10, eos) for p in prompts]
    assert any(len(w) > 3 for w in want), "the reference stopped at once: nothing compared"
    assert got == want


def _tiny_generate(s: decoding.Sampling, prompts=((5, 6, 7), (9, 10, 11, 12, 13))):
    keys, net, params = tiny("llama3_tiny")
    vocab = seqio.ByteVocabulary()
    return list(decoding.generate(net, params, vocab, [list(p) for p in prompts], s,
                                  batch_size=2))


def test_greedy_is_the_argmax_of_the_full_forward_each_step() -> None:
    keys, net, params = tiny("llama3_tiny")
    got = _tiny_generate(decoding.Sampling(max_new_tokens=6))
    for prompt, decodes in zip(((5, 6, 7), (9, 10, 11, 12, 13)), got, strict=True):
        seq = list(prompt)
        for _ in range(6):  # the reference: a whole forward per token, no cache
            tokens = jnp.asarray([[0, *seq]])  # BOS 0 is a real position (targets all 1)
            logits = net.apply({"params": params}, tokens, jnp.ones_like(tokens),
                               enable_dropout=False)
            nxt = int(jnp.argmax(logits[0, -1]))
            if nxt == 1:
                break
            seq.append(nxt)
        assert decodes[0][0] == seq[len(prompt):]


def test_sampling_follows_its_seed_and_settings() -> None:
    sample = dict(method="sample", temperature=1.5, max_new_tokens=8, num_samples=3)
    a = _tiny_generate(decoding.Sampling(**sample, seed=1))
    b = _tiny_generate(decoding.Sampling(**sample, seed=1))
    c = _tiny_generate(decoding.Sampling(**sample, seed=2))
    assert a == b and a != c
    assert all(len(row) == 3 for row in a)
    greedy = _tiny_generate(decoding.Sampling(max_new_tokens=8))
    top1 = _tiny_generate(decoding.Sampling(method="sample", top_k=1, temperature=2.0,
                                            max_new_tokens=8, seed=5))
    assert [r[0][0] for r in top1] == [r[0][0] for r in greedy]
    tiny_p = _tiny_generate(decoding.Sampling(method="sample", top_p=1e-6, max_new_tokens=8))
    assert [r[0][0] for r in tiny_p] == [r[0][0] for r in greedy]


def test_beam_search_returns_best_first_and_stop_tokens_cut() -> None:
    beams = _tiny_generate(decoding.Sampling(method="beam", num_beams=4, num_samples=3,
                                             max_new_tokens=6))
    for row in beams:
        scores = [score for _, score in row]
        assert len(row) == 3 and scores == sorted(scores, reverse=True)
    greedy = _tiny_generate(decoding.Sampling(max_new_tokens=6))
    first = greedy[0][0][0]
    assert len(first) >= 2, "greedy output too short to cut"
    stopped = _tiny_generate(decoding.Sampling(max_new_tokens=6, stop_tokens=(first[1],)))
    assert stopped[0][0][0] == first[:first.index(first[1])]
    short = _tiny_generate(decoding.Sampling(max_new_tokens=2))
    assert short[0][0][0] == first[:2]


def _counting_steps(monkeypatch) -> list[int]:
    """Each decode step (one tokens_to_logits call inside T5X's loop) appends to the list."""
    steps: list[int] = []
    original = decoding.decode_fn

    def counted(s: decoding.Sampling):
        fn = original(s)

        def decode(*, tokens_to_logits, **kwargs):
            def count(state):
                jax.debug.callback(lambda: steps.append(1))
                return tokens_to_logits(state)
            return fn(tokens_to_logits=count, **kwargs)
        return decode

    monkeypatch.setattr(decoding, "decode_fn", counted)
    return steps


@pytest.mark.parametrize("sample", [{}, {"method": "sample", "temperature": 1.5,
                                         "num_samples": 2, "seed": 3}])
def test_stops_end_the_decode_loop_early_with_the_cut_output(monkeypatch, sample) -> None:
    from capibara_exp.runtime import stopping

    steps = _counting_steps(monkeypatch)
    max_new = 12
    full = _tiny_generate(decoding.Sampling(max_new_tokens=max_new, **sample))
    full_steps = len(steps)
    rows = [ids for row in full for ids, _ in row]
    assert all(len(ids) >= 3 for ids in rows), "outputs too short to stop inside"
    # every row stops by its third token: the loop can end long before max_new_tokens
    singles = tuple(sorted({ids[1] for ids in rows}))
    pairs = tuple(sorted({(ids[1], ids[2]) for ids in rows}))
    for stops in ({"stop_tokens": singles}, {"stop_sequences": pairs}):
        steps.clear()
        stopped = _tiny_generate(decoding.Sampling(max_new_tokens=max_new, **sample, **stops))
        want_stops = [(t,) for t in stops.get("stop_tokens", ())] + list(
            stops.get("stop_sequences", ()))
        # the same samples; T5X orders a prompt's samples by score, and an early-stopped
        # sample's score leaves out the tokens after its stop, so compare them sorted
        want = [sorted(stopping.cut(ids, want_stops) for ids, _ in row) for row in full]
        got = [sorted(ids for ids, _ in row) for row in stopped]
        assert got == want
        assert len(steps) <= 4 < max_new <= full_steps, (len(steps), full_steps)
