"""Microbatching overhead: the trainer's step at num_microbatches 1, 2 and 4, equal global batch.

One process, one model (the default experiment's network, or overrides), one fixed device
batch; each setting is compiled, warmed up, then timed over interleaved rounds so drift in
the machine's speed hits all settings alike. Prints the median step time of each and its
ratio to num_microbatches=1 (gradient accumulation through lax.scan: same FLOPs, smaller
matmuls, one extra accumulation per microbatch), and each setting's MFU against the
measured matmul peak (analytic FLOPs, metrics.model_flops_per_token).

    python bench/microbatch.py [--rounds 5] [--steps 8] [--batch 32] [key=value overrides...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

SETTINGS = (1, 2, 4)


def build(overrides: list[str], model_dir: Path):
    """(model, train data config, learning-rate fn) from the composed config's gin."""
    from step_time import compose  # sibling script: bench/ is the script dir on sys.path

    import gin
    from capibara_exp import experiment
    from capibara_exp.runtime import gin_utils

    path = experiment.write_gin(compose(overrides, model_dir), model_dir, {})
    gin_utils.parse(path)
    get = lambda name: gin.query_parameter(name).scoped_configurable_fn()  # noqa: E731
    return (get("train_script.train.model"), get("train_script.train.train_dataset_cfg"),
            gin.get_configurable("trainer.Trainer"))


def time_steps(trainer, state, batch, steps: int):
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(state.params)
    return state, (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round")
    parser.add_argument("--batch", type=int, default=32, help="global batch (examples)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from capibara_exp.runtime import inputs, partitioning
    from capibara_exp.runtime.metrics import matmul_peak_flops, model_flops_per_token
    from capibara_exp.runtime.train_script import initial_state

    peak = matmul_peak_flops()
    with tempfile.TemporaryDirectory() as tmp:
        model, data_cfg, trainer_cls = build([f"data.batch_size={args.batch}", *args.overrides],
                                             Path(tmp))
    batch = jax.device_put(next(inputs.batches(data_cfg, model.FEATURE_CONVERTER_CLS, seed=0)))
    batch_size, length = batch["decoder_target_tokens"].shape
    runs = {}
    for n in SETTINGS:
        state, axes = initial_state(model, jax.random.PRNGKey(0), batch_size, length)
        trainer = trainer_cls(model=model, train_state=state,
                              partitioner=partitioning.PjitPartitioner(), eval_names=[],
                              summary_dir=None, train_state_axes=axes, rng=jax.random.PRNGKey(1),
                              num_microbatches=n)
        trainer.check_batch_size(batch_size)
        state, _ = time_steps(trainer, trainer.prepare_state(state), batch, 2)  # compile, warm
        runs[n] = [trainer, state, []]
    for _ in range(args.rounds):  # interleaved: each round times every setting once
        for run in runs.values():
            run[1], seconds = time_steps(run[0], run[1], batch, args.steps)
            run[2].append(seconds)

    flops = batch_size * length * model_flops_per_token(
        runs[1][1].params, getattr(model.module, "config", None), length)
    base = float(np.median(runs[1][2]))
    print(f"\nglobal batch {batch_size} x {length} tokens; {args.rounds} rounds x {args.steps} "
          f"steps; matmul peak {peak / 1e9:.1f} GFLOP/s")
    print("num_microbatches  microbatch  median ms/step  ratio to 1   MFU")
    for n, (_, _, times) in runs.items():
        median = float(np.median(times))
        print(f"{n:>16}  {batch_size // n:>10}  {median * 1e3:>14.2f}  {median / base:>10.3f}"
              f"  {flops / median / peak:5.1%}")


if __name__ == "__main__":
    main()
