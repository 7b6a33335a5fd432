"""Steady-state step time: the local runtime vs a minimal hand-written jitted loop.

Both train the same model on the same batch shape, in one process, one after the other:
  1. this CPU's f32 matmul peak (best of several large jitted matmuls),
  2. a bare loop: one jitted value_and_grad + optax update on one fixed device batch,
  3. the local runtime: `capibara-exp`'s train_script.train through config.gin, with the
     real SeqIO input pipeline, metrics and checkpoints (steady-state steps, first excluded).
Prints the ratio runtime/bare (goal: at most 1.05) and the model FLOP/s as a fraction of
the measured peak. FLOPs per step come from XLA's cost analysis of the bare step.

    python bench/step_time.py [--steps 60] [key=value overrides...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax


def compose(overrides: list[str], model_dir: Path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[f"model_dir={model_dir}", *overrides])


def prepared_gin(cfg, model_dir: Path) -> Path:
    """config.gin for `cfg` in model_dir, the data it reads built first, as a run builds
    them (the data dir exported for the tasks, experiment.prepare_data: tasks only read)."""
    import os

    from capibara_exp import experiment

    os.environ[experiment.DATA_DIR_ENV] = str(cfg.data_dir)
    return experiment.write_gin(cfg, model_dir, {}, lambda: experiment.prepare_data(cfg))


def bare_loop(model, batch: dict, steps: int) -> tuple[float, float]:
    """(median seconds per step, FLOPs per step) of a minimal jitted train step."""
    shape = batch["decoder_target_tokens"].shape
    variables = model.get_initial_variables(jax.random.PRNGKey(0), *shape)
    params = variables["params"]
    tx = model.optimizer_def.optax_optimizer
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: model.loss_fn(p, batch, None)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(step, donate_argnums=(0, 1))
    batch = jax.device_put(batch)
    flops = jitted.lower(params, opt_state, batch).compile().cost_analysis().get("flops", 0.0)
    params, opt_state = jitted(params, opt_state, batch)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state = jitted(params, opt_state, batch)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=dense_small")
    args = parser.parse_args()

    import gin

    from capibara_exp.runtime import gin_utils, inputs
    from capibara_exp.runtime.metrics import matmul_peak_flops

    peak = matmul_peak_flops()  # the same measurement the train metrics' MFU uses
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        steps = args.steps
        cfg = compose([f"trainer.train_steps={steps + 1}", f"trainer.eval_period={steps + 1}",
                       f"trainer.stats_period={steps + 1}", "trainer.eval_steps=0",
                       f"checkpoint.checkpoint_period={steps + 1}", *args.overrides], model_dir)
        path = prepared_gin(cfg, model_dir)
        gin_utils.parse(path)
        model = gin.query_parameter("train_script.train.model").scoped_configurable_fn()
        train_ref = gin.query_parameter("train_script.train.train_dataset_cfg")
        train_cfg = train_ref.scoped_configurable_fn()
        batch = next(inputs.batches(train_cfg, model.FEATURE_CONVERTER_CLS, seed=0))
        bare_s, flops = bare_loop(model, batch, steps)

        gin_utils.run_train(path)
        lines = (model_dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        train_records = [r for r in records if r["split"] == "train"]
        runtime_s = train_records[-1]["step_time_s"]
        data_wait = train_records[-1]["data_wait_share"]

    shape = batch["decoder_target_tokens"].shape
    print(f"\nbatch {shape[0]} x {shape[1]} tokens, {steps} steady-state steps each")
    print(f"CPU f32 matmul peak:      {peak / 1e9:8.1f} GFLOP/s")
    print(f"bare jitted loop:         {bare_s * 1e3:8.2f} ms/step  "
          f"{flops / bare_s / 1e9:6.1f} GFLOP/s = {flops / bare_s / peak:5.1%} of peak")
    print(f"local runtime:            {runtime_s * 1e3:8.2f} ms/step  "
          f"{flops / runtime_s / 1e9:6.1f} GFLOP/s = {flops / runtime_s / peak:5.1%} of peak"
          f"  (data wait {data_wait:.1%} of step time)")
    print(f"ratio runtime / bare:     {runtime_s / bare_s:8.3f}   (goal <= 1.05)")


if __name__ == "__main__":
    main()
