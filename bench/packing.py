"""Packing throughput: the Cython kernels vs their pure-Python references vs seqio itself.

On the same examples (lognormal lengths, median 80 tokens, sigma 1), in one process:
  1. kernel first-fit and next-fit vs the references in packing_ref.py (goal >= 20x):
     - in one call on all examples, beside the memory floor of that call: allocating the
       three outputs and writing every slot once. With ~80 MB of fresh outputs the floor
       is mostly the OS faulting in and zeroing new pages, which no packer can avoid;
     - streamed in calls of --examples-per-call, as a pipeline packs, where the outputs
       reuse warm memory. The call size is a multiple of seqio's chunk (L examples), so
       next-fit's output is the same as in one call; first-fit's rows do not span calls.
  2. kernel next-fit vs seqio.utils.trim_and_pack_dataset over a tf.data dataset of the same
     examples, fully iterated (checked identical to the kernel's output); and, to show where
     seqio's time goes, the same pipeline up to what its packer consumes (trim and
     padded_batch into chunks of L examples) iterated without the packer,
  3. fill (real tokens / all slots) of first-fit vs next-fit.
Times are the best of --repeats runs (references: half as many): this machine is shared.

    python bench/packing.py [--examples 50000] [--length 512] [--examples-per-call 4096]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from capibara_exp.kernels import packing, packing_ref

PACKERS = ("pack_first_fit", "pack_next_fit")


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def write_outputs(rows: int, length: int) -> None:
    """The least any packer returning fresh outputs does: allocate them, write every slot."""
    outputs = [np.empty((rows, length), np.int32) for _ in range(3)]  # alive together
    for output in outputs:
        output.fill(1)


def in_calls(pack: Callable, tokens: np.ndarray, lengths: np.ndarray, length: int,
             examples_per_call: int) -> Callable[[], float]:
    """A function packing the examples call by call, as a pipeline would; returns the fill.

    Each call's outputs are dropped once counted, as a pipeline frees a consumed batch.
    """
    starts = np.concatenate([[0], np.cumsum(lengths)])

    def run() -> float:
        real = slots = 0
        for a in range(0, lengths.size, examples_per_call):
            b = min(a + examples_per_call, lengths.size)
            segment_ids = pack(tokens[starts[a] : starts[b]], lengths[a:b], length)[1]
            real, slots = real + np.count_nonzero(segment_ids), slots + segment_ids.size
        return real / slots

    return run


def fill(segment_ids_BxL: np.ndarray) -> float:
    return np.count_nonzero(segment_ids_BxL) / segment_ids_BxL.size


def seqio_datasets(tokens: np.ndarray, lengths: np.ndarray, length: int):
    """(seqio-packed dataset, seconds to build it, the same up to its packer's input)."""
    import seqio  # lazily: seqio imports TensorFlow
    import tensorflow as tf

    def source():
        ragged = tf.RaggedTensor.from_row_lengths(tokens, lengths)
        return tf.data.Dataset.from_tensor_slices(ragged).map(lambda x: {"targets": x})

    t0 = time.perf_counter()
    packed = seqio.utils.trim_and_pack_dataset(source(), {"targets": length})
    build_s = time.perf_counter() - t0
    # What trim_and_pack_dataset does before packing: trim, then padded_batch(L).
    chunks = source().map(lambda x: {"targets": x["targets"][:length]}).padded_batch(
        length, padded_shapes={"targets": [-1]})
    return packed, build_s, chunks


def iterate_seconds(ds) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    rows = list(ds.as_numpy_iterator())
    return time.perf_counter() - t0, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50_000)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--examples-per-call", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n, length, per_call, repeats = args.examples, args.length, args.examples_per_call, args.repeats

    rng = np.random.default_rng(0)
    lengths = np.ceil(rng.lognormal(np.log(80), 1.0, n)).astype(np.int64)
    tokens = rng.integers(1, 32_000, lengths.sum()).astype(np.int32)
    print(f"{n} examples, {tokens.size} tokens (median {np.median(lengths):.0f}, "
          f"mean {lengths.mean():.0f}, {np.mean(lengths > length):.1%} over {length}), L={length}")

    outputs, one_call_s = {}, {}
    print(f"\none call on all {n} examples")
    for name in PACKERS:
        kernel, reference = getattr(packing, name), getattr(packing_ref, name)
        outputs[name] = kernel(tokens, lengths, length)  # also the first, cold call
        one_call_s[name] = best_seconds(lambda k=kernel: k(tokens, lengths, length), repeats)
        ref_s = best_seconds(lambda r=reference: r(tokens, lengths, length),
                             max(1, repeats // 2))
        floor_s = best_seconds(lambda rows=outputs[name][0].shape[0]: write_outputs(rows, length),
                               repeats)
        print(f"  {name:15s} kernel {n / one_call_s[name]:11,.0f} ex/s   reference "
              f"{n / ref_s:9,.0f} ex/s   ratio {ref_s / one_call_s[name]:5.1f}x (goal >= 20x)   "
              f"kernel {one_call_s[name] * 1e3:5.1f} ms = {one_call_s[name] / floor_s:.2f}x "
              f"the floor of {floor_s * 1e3:.1f} ms")

    print(f"\nstreamed in calls of {per_call} examples")
    for name in PACKERS:
        kernel = in_calls(getattr(packing, name), tokens, lengths, length, per_call)
        reference = in_calls(getattr(packing_ref, name), tokens, lengths, length, per_call)
        kernel_s = best_seconds(kernel, repeats)
        ref_s = best_seconds(reference, max(1, repeats // 2))
        print(f"  {name:15s} kernel {n / kernel_s:11,.0f} ex/s   reference {n / ref_s:9,.0f} "
              f"ex/s   ratio {ref_s / kernel_s:5.1f}x (goal >= 20x)   fill {kernel():.4f}")

    packed_ds, build_s, chunks_ds = seqio_datasets(tokens, lengths, length)
    seqio_s, rows = iterate_seconds(packed_ds)
    chunks_s, _ = iterate_seconds(chunks_ds)
    keys = ("targets", "targets_segment_ids", "targets_positions")
    identical = all(
        np.array_equal(np.stack([r[k] for r in rows]), got)
        for k, got in zip(keys, outputs["pack_next_fit"], strict=True)
    )
    print(f"\nseqio trim_and_pack_dataset, iterated   {n / seqio_s:9,.0f} ex/s   "
          f"(+{build_s:.2f} s to build); kernel next-fit in one call is "
          f"{seqio_s / one_call_s['pack_next_fit']:,.0f}x faster; outputs identical: {identical}")
    print(f"  the same without its packer           {n / chunks_s:9,.0f} ex/s   "
          f"(the packer is {1 - chunks_s / seqio_s:.0%} of seqio's time)")

    print()
    for name, (_, segment_ids, _) in outputs.items():
        print(f"{name:15s} fill {fill(segment_ids):.4f} over {segment_ids.shape[0]} rows")


if __name__ == "__main__":
    main()
