"""Decoding and execution scoring against bare baselines, measured in one run.

prefill: T5X's cache prefill (runtime/decoding.py's path: the cache made, the prompt in
one `prefill=True` call over the decoder's whole length, as T5X lays it out) against a bare
jitted forward over the prompt tokens alone, and over the same padded length.
decode: the whole greedy generation program (T5X's DecoderOnlyModel.predict_batch_with_aux
with temperature_sample, top-1) against a bare jitted loop over the same network: the
same prefill, then lax.fori_loop of one-token decode steps and argmax. Ratios are time over
the baseline's time (<= 1.15 is the goal); tokens/s are new tokens over wall time.
The programs compared are timed interleaved: after one compile call each, every round calls
each once (the order reversed every other round), so load that comes and goes on the shared
machine falls on both sides alike; a ratio is the median over rounds of the round's ratio,
times and tokens/s are medians.
cache: the bytes of the 'cache' collection against 2 x layers x batch x kv_heads x head_dim
x length x itemsize (+ the index). sandbox: programs/s of generation/execution.py's sandbox
against bare `python -c` subprocesses of the same programs.

    python bench/decode.py [--entry llama3_tiny] [--batch 4] [--prompt 64] [--new 64]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

ROUNDS = 21


def interleaved(fns: dict, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Each function's wall times over `rounds` rounds of one call each, after a compile."""
    for fn in fns.values():
        fn()
    names, times = list(fns), {name: [] for name in fns}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def round_ratios(times: dict[str, list[float]], ours: str, base: str) -> list[float]:
    """ours / base in each round."""
    return [a / b for a, b in zip(times[ours], times[base], strict=True)]


def network(entry: str, batch: int, length: int):
    import jax
    import jax.numpy as jnp

    from capibara_exp.convert.hf_export import compose_entry
    from capibara_exp.convert.network import network as make

    keys = {**compose_entry(entry), "dtype": "float32"}
    net = make(keys)
    tokens = jnp.ones((batch, length), jnp.int32)
    params = net.init(jax.random.PRNGKey(0), tokens, tokens, enable_dropout=False)["params"]
    return keys, net, params


def prefill_fn(net, length: int):
    import jax
    import jax.numpy as jnp

    def prefill(params, prompt):
        ones = jnp.ones((prompt.shape[0], length), jnp.int32)
        _, made = net.apply({"params": params}, ones, ones, enable_dropout=False, decode=True,
                            mutable=["cache"])
        padded = jnp.zeros_like(ones).at[:, :prompt.shape[1]].set(prompt)
        causal = (jnp.arange(length)[None] < prompt.shape[1]).astype(jnp.int32) * ones
        _, filled = net.apply({"params": params, "cache": made["cache"]}, padded, causal,
                              enable_dropout=False, decode=True, prefill=True,
                              prefill_lengths=jnp.full((prompt.shape[0],), prompt.shape[1]),
                              mutable=["cache"])
        return filled["cache"]

    return jax.jit(prefill)


def bare_generate_fn(net, length: int, prompt_len: int, new: int):
    import jax
    import jax.numpy as jnp

    prefill = prefill_fn(net, length)

    def generate(params, prompt):
        cache = prefill(params, prompt)

        def body(i, carry):
            cache, token, out = carry
            logits, v = net.apply({"params": params, "cache": cache}, token, token,
                                  enable_dropout=False, decode=True, max_decode_length=length,
                                  mutable=["cache"])
            nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
            return v["cache"], nxt, out.at[:, i].set(nxt[:, 0])

        out = jnp.zeros((prompt.shape[0], new), jnp.int32)
        return jax.lax.fori_loop(0, new, body, (cache, prompt[:, -1:], out))[2]

    return jax.jit(generate)


def measure_decoding(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import seqio

    from capibara_exp.runtime import decoding

    length = args.prompt + 1 + args.new
    keys, net, params = network(args.entry, args.batch, length)
    prompt = jnp.asarray(np.random.default_rng(0).integers(3, 250, (args.batch, args.prompt)),
                         jnp.int32)
    bare_forward = jax.jit(lambda p, t: net.apply({"params": p}, t, t, enable_dropout=False))
    prefill = prefill_fn(net, length)
    padded = jnp.zeros((args.batch, length), jnp.int32).at[:, :args.prompt].set(prompt)
    bare = bare_generate_fn(net, length, args.prompt, args.new)
    s = decoding.Sampling(max_new_tokens=args.new)
    model = decoding.t5x_model(net, seqio.ByteVocabulary(), s)
    program = decoding.predict_program(model, s)
    batch = {k: jnp.asarray(v) for k, v in decoding.prompt_batch(
        [list(map(int, row)) for row in np.asarray(prompt)], length).items()}
    times = interleaved({
        "bare_fwd": lambda: jax.block_until_ready(bare_forward(params, prompt)),
        "bare_padded": lambda: jax.block_until_ready(bare_forward(params, padded)),
        "prefill": lambda: jax.block_until_ready(prefill(params, prompt)),
        "bare_gen": lambda: jax.block_until_ready(bare(params, prompt)),
        "gen": lambda: jax.block_until_ready(program(params, batch, jax.random.PRNGKey(0)))})
    med = {name: statistics.median(ts) for name, ts in times.items()}
    decode = round_ratios(times, "gen", "bare_gen")
    cache = prefill(params, prompt)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    kv = keys.get("num_kv_heads") or keys["num_heads"]
    analytic = 2 * keys["num_layers"] * args.batch * kv * keys["head_dim"] * length * 4 + \
        keys["num_layers"] * args.batch * 4  # each layer's [B] int32 cache index
    new_tokens = args.batch * args.new
    return {"prefill_ratio": statistics.median(round_ratios(times, "prefill", "bare_fwd")),
            "prefill_ratio_same_length": statistics.median(
                round_ratios(times, "prefill", "bare_padded")),
            "prefill_tokens_per_s": args.batch * args.prompt / med["prefill"],
            "bare_forward_tokens_per_s": args.batch * args.prompt / med["bare_fwd"],
            "decode_ratio": statistics.median(decode),
            "decode_ratio_of_medians": med["gen"] / med["bare_gen"],
            "decode_ratio_low": min(decode), "decode_ratio_high": max(decode),
            "decode_tokens_per_s": new_tokens / med["gen"],
            "bare_loop_tokens_per_s": new_tokens / med["bare_gen"],
            "cache_bytes": cache_bytes, "cache_analytic_bytes": analytic,
            "cache_ratio": cache_bytes / analytic}


def measure_sandbox(n: int) -> dict:
    from capibara_exp.generation import execution

    code = "print(sum(i * i for i in range(1000)))\n"
    python = execution.interpreter()
    t0 = time.perf_counter()
    for _ in range(n):
        assert execution.run_program(code).ok
    ours = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        subprocess.run([python, "-c", code], capture_output=True, check=True)
    bare = n / (time.perf_counter() - t0)
    return {"sandbox_programs_per_s": ours, "bare_programs_per_s": bare,
            "sandbox_ratio": ours / bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default="llama3_tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--programs", type=int, default=30)
    args = parser.parse_args()
    from capibara_exp.base import environment

    environment.prepare()
    results = {**measure_decoding(args), **measure_sandbox(args.programs)}
    for key, value in results.items():
        print(f"{key:28s} {value:,.3f}")
    print(f"prefill {results['prefill_ratio']:.2f}x bare forward of the prompt "
          f"({results['prefill_ratio_same_length']:.2f}x at the same length), decode "
          f"{results['decode_ratio']:.2f}x bare loop (goal <= 1.15; rounds "
          f"{results['decode_ratio_low']:.2f}-{results['decode_ratio_high']:.2f}x), cache "
          f"{results['cache_ratio']:.3f}x analytic, sandbox {results['sandbox_ratio']:.2f}x "
          "bare subprocesses (programs/s)")


if __name__ == "__main__":
    main()
