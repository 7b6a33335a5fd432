"""Input pipeline throughput: seqio's feature converter vs the kernel packers, end to end.

The same task, split, seed and batch shape through capibara_exp.runtime.inputs.batches
with each packer, in one process: batches/s and real (non-padding) tokens/s after a
warm-up, and the packing fill. Real tokens/s is what a train step can consume; the
default run's data-wait share (metrics.jsonl) shows whether the pipeline keeps up.

    python bench/data_pipeline.py [--task capibara_bytes_lm] [--length 128] [--batch 16]
        [--batches 300] [--data-dir /tmp/capibara-bench-data]
"""

from __future__ import annotations

import argparse
import os
import time


def measure(cfg, strategy: str, n_batches: int, warmup: int) -> tuple[float, float, float]:
    """(batches/s, real tokens/s, fill) of one packer after `warmup` batches."""
    import seqio

    from capibara_exp.data import packing
    from capibara_exp.runtime import inputs

    it = inputs.batches(cfg, seqio.DecoderFeatureConverter, 0, packer=packing.Packer(strategy))
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    real = 0
    for _ in range(n_batches):
        real += int((next(it)["decoder_segment_ids"] > 0).sum())
    seconds = time.perf_counter() - t0
    slots = n_batches * cfg.batch_size * cfg.task_feature_lengths["targets"]
    return n_batches / seconds, real / seconds, real / slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="capibara_bytes_lm")
    parser.add_argument("--module", default="capibara_exp.data.tasks")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--data-dir", default="/tmp/capibara-bench-data")
    args = parser.parse_args()
    os.environ.setdefault("CAPIBARA_DATA_DIR", args.data_dir)
    from capibara_exp.data import corpus

    if corpus.reads_corpus(args.task):  # the task only reads: its data built here first
        corpus.build_corpus(os.environ["CAPIBARA_DATA_DIR"])
    from capibara_exp.runtime.utils import DatasetConfig

    cfg = DatasetConfig(
        mixture_or_task_name=args.task,
        task_feature_lengths={"targets": args.length},
        split="train",
        batch_size=args.batch,
        shuffle=True,
        seed=0,
        pack=True,
        module=args.module,
    )
    print(
        f"{args.task}: batches of {args.batch} x {args.length}, "
        f"{args.batches} batches after warm-up"
    )
    results = {}
    for strategy in ("seqio", "next_fit", "first_fit"):
        results[strategy] = measure(cfg, strategy, args.batches, warmup=20)
        bps, tps, fill = results[strategy]
        print(
            f"  {strategy:9s} {bps:8.1f} batches/s  {tps / 1e3:8.1f}k real tokens/s  "
            f"fill {fill:.4f}"
        )
    base = results["seqio"]
    for strategy in ("next_fit", "first_fit"):
        bps, tps, _ = results[strategy]
        print(
            f"  {strategy} vs seqio: {bps / base[0]:.2f}x batches/s, "
            f"{tps / base[1]:.2f}x real tokens/s"
        )


if __name__ == "__main__":
    main()
