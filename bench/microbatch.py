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
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

SETTINGS = (1, 2, 4)


def build(overrides: list[str], model_dir: Path):
    """(model, train data config, trainer class, partitioner) from the composed config's gin
    (a MoE experiment gets its MoeTrainer and MoePjitPartitioner)."""
    import gin
    from step_time import compose, prepared_gin  # sibling script: bench/ is on sys.path

    from capibara_exp.runtime import gin_utils

    path = prepared_gin(compose(overrides, model_dir), model_dir)
    gin_utils.parse(path)
    get = lambda name: gin.query_parameter(name).scoped_configurable_fn  # noqa: E731
    return (get("train_script.train.model")(), get("train_script.train.train_dataset_cfg")(),
            get("train_script.train.trainer_cls"), get("train_script.train.partitioner")())


def time_steps(trainer, state, batch, steps: int):
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(state.params)
    return state, (time.perf_counter() - t0) / steps


def time_settings(make_trainer: Callable[[int], tuple], batch: dict, rounds: int, steps: int,
                  settings: tuple[int, ...] = SETTINGS) -> dict[int, list[float]]:
    """num_microbatches -> seconds per step of each timed round. `make_trainer(n)` gives
    (trainer, prepared state) for n microbatches; every setting is compiled and warmed up
    first, then the rounds time each setting once in turn (drift hits all alike)."""
    runs = {}
    for n in settings:
        trainer, state = make_trainer(n)
        trainer.check_batch_size(batch["decoder_target_tokens"].shape[0])
        state, _ = time_steps(trainer, state, batch, 2)  # compile, warm
        runs[n] = [trainer, state, []]
    for _ in range(rounds):
        for run in runs.values():
            run[1], seconds = time_steps(run[0], run[1], batch, steps)
            run[2].append(seconds)
    return {n: run[2] for n, run in runs.items()}


def print_table(times: dict[int, list[float]], batch_size: int, flops_per_step: float,
                peak: float) -> None:
    """Median ms per step, ratio to the first setting, and MFU, per num_microbatches."""
    base = float(np.median(times[min(times)]))
    print("num_microbatches  microbatch  median ms/step  ratio to 1   MFU")
    for n, seconds in times.items():
        median = float(np.median(seconds))
        print(f"{n:>16}  {batch_size // n:>10}  {median * 1e3:>14.2f}  {median / base:>10.3f}"
              f"  {flops_per_step / median / peak:5.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round")
    parser.add_argument("--batch", type=int, default=32, help="global batch (examples)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from capibara_exp.runtime import inputs
    from capibara_exp.runtime.metrics import matmul_peak_flops, model_flops_per_token
    from capibara_exp.runtime.state import initial_state

    with tempfile.TemporaryDirectory() as tmp:
        model, data_cfg, trainer_cls, partitioner = build(
            [f"data.batch_size={args.batch}", *args.overrides], Path(tmp))
    net_config = getattr(model.module, "config", None)
    peak = matmul_peak_flops(dtype=getattr(net_config, "dtype", "float32"))
    batch = jax.device_put(next(inputs.batches(data_cfg, model.FEATURE_CONVERTER_CLS, seed=0)),
                           partitioner.data_sharding())
    batch_size, length = batch["decoder_target_tokens"].shape

    def make_trainer(n: int):
        state, axes = initial_state(model, jax.random.PRNGKey(0), batch_size, length)
        trainer = trainer_cls(model=model, train_state=state, partitioner=partitioner,
                              eval_names=[], summary_dir=None, train_state_axes=axes,
                              rng=jax.random.PRNGKey(1), num_microbatches=n)
        return trainer, trainer.prepare_state(state)

    times = time_settings(make_trainer, batch, args.rounds, args.steps)
    flops = batch_size * length * model_flops_per_token(
        net_config, length, getattr(model.module, "moe_config", None))
    print(f"\nglobal batch {batch_size} x {length} tokens; {args.rounds} rounds x {args.steps} "
          f"steps; matmul peak {peak / 1e9:.1f} GFLOP/s")
    print_table(times, batch_size, flops, peak)


if __name__ == "__main__":
    main()
