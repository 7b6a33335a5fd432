"""LoRA and QLoRA against full fine-tuning: train-step memory, step time and quality.

    python bench/lora.py                    # all three parts (about 15-25 min on 2 cores)
    python bench/lora.py --skip-tpu --skip-quality --rounds 1

1. This CPU, moe_e2b_tiny and dense_small_rope: one process per (model, mode). Modes: the
   full fine-tune, LoRA (lora=attention, rank 8), QLoRA (the same with quantize_base=nf4),
   and the frozen model's forward+backward: the loss and its backpropagation through every
   layer, without weight gradients (what any adapter method pays; the gradient of the first
   layer's norm scale). Each process reports XLA's memory analysis of its compiled step, the
   bytes per device of its trained state and of its frozen base (XLA's argument sizes of a
   program that reads only them), its peak RSS and its median step time on a fixed batch.
   The modes' processes take turns for `--rounds` rounds; each keeps its fastest round.
2. The same memory figures from ahead-of-time compiles of moe_e2b_base for TPU v5e-8
   (libtpu, no TPU needed; bf16 compute; 8 expert partitions, batch 16 x 2048).
3. Quality: moe_e2b_tiny pretrained on the routing mixture, then LoRA and QLoRA from that
   checkpoint for the same steps, same data and seed: their final eval losses.

Goals, printed with PASS/FAIL: QLoRA's base <= 30% of the bf16 full fine-tune's parameters
+ optimizer state (moe_e2b_base on v5e); LoRA step time <= 1.1x the frozen forward+backward
(each CPU model; in wall time and in CPU time, the worse of the two counts, since a shared
machine distorts wall time); QLoRA eval loss within 2% of LoRA's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("full", "frozen_fwd_bwd", "lora", "qlora")
LORA = ["lora=attention"]
QLORA = [*LORA, "lora.quantize_base=nf4"]
CPU_MODELS = ("moe_e2b_tiny", "dense_small_rope")
# 8 expert partitions on the 8 chips; batch 16 x 2048 (2 sequences per chip: at 32 the full
# fine-tune's temporaries alone need 17.0 GiB of a chip's 15.75).
TPU_OVERRIDES = ["partitioning.num_expert_partitions=8", "data.batch_size=16"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.cli.common import register_resolvers

    register_resolvers()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=["model_dir=/tmp/capibara-bench-lora",
                                                  *overrides])


# ---- one (model, mode) in its own process ------------------------------------------------

def device_bytes(shapes, shardings) -> int:
    """XLA's argument bytes per device of a program that reads every leaf of `shapes`."""
    import jax

    read = jax.jit(lambda tree: [x.reshape(-1)[:1] for x in jax.tree.leaves(tree)],
                   in_shardings=(shardings,))
    return int(read.lower(shapes).compile().memory_analysis().argument_size_in_bytes)


def memory(compiled) -> dict:
    """XLA's memory analysis of a compiled step, per device: its arguments, temporaries, and
    in all (arguments + outputs - aliased + temporaries + code, as the mesh planner counts)."""
    stats = compiled.memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes
             + stats.generated_code_size_in_bytes)
    return {"argument_bytes": int(stats.argument_size_in_bytes),
            "temp_bytes": int(stats.temp_size_in_bytes), "step_bytes": int(total)}


def frozen_fwd_bwd(model, params, axes, partitioner):
    """The frozen model's loss and its backward pass through every layer: the gradient of
    the first layer's pre-attention norm scale, so XLA computes no other weight gradient."""
    import jax
    from flax import traverse_util

    flat = traverse_util.flatten_dict(params, sep="/")
    first = min(k for k in flat if k.endswith("pre_self_attention_layer_norm/scale"))
    rest = {k: v for k, v in flat.items() if k != first}

    def loss(scale, rest, batch):
        tree = traverse_util.unflatten_dict({**rest, first: scale}, sep="/")
        return model.loss_fn(tree, batch, None)[0]

    shardings = traverse_util.flatten_dict(partitioner.shardings(axes), sep="/")
    step = jax.jit(jax.value_and_grad(loss), in_shardings=(
        shardings[first], {k: shardings[k] for k in rest}, partitioner.data_sharding()))
    return step, (flat[first], rest)


def build(mode: str, experiment: str, base_dir: Path, tpu: str | None):
    """(model, dataset config, state, axes) of one mode, from the experiment's config.gin;
    shapes only for a TPU topology. Mode 'base' writes the checkpoint the LoRA modes read."""
    import jax

    from capibara_exp.base import topologies
    from capibara_exp.runtime import checkpoints
    from capibara_exp.runtime import state as run_state
    from capibara_exp.tuning import aot, tpu_slice

    extra = {"lora": LORA, "qlora": QLORA}.get(mode, [])
    overrides = [f"experiment={experiment}", *extra, *(TPU_OVERRIDES if tpu else [])]
    if extra:
        overrides.append(f"lora.base_checkpoint={base_dir}")
    devices = tpu_slice.devices(topologies.get(tpu)) if tpu else jax.devices()
    bindings = aot.train_bindings(aot.render_local_gin(compose(overrides)), devices)
    model, data_cfg = bindings["model"], bindings["train_dataset_cfg"]
    length = max(data_cfg.task_feature_lengths.values())
    if tpu:
        state, axes = run_state.state_shapes(model, data_cfg.batch_size, length)
    else:
        state, axes = run_state.initial_state(model, jax.random.PRNGKey(0),
                                              data_cfg.batch_size, length)
    if mode == "base":
        mgr = checkpoints.manager(base_dir)
        checkpoints.save(mgr, 1, state.state_dict())
        mgr.close()
    return bindings, state, axes


def fixed_batch(shapes: dict, sharding) -> dict:
    """A batch of random tokens, one sequence per row, for timing."""
    import jax
    import numpy as np

    rows, length = shapes["decoder_target_tokens"].shape
    tokens = np.random.default_rng(0).integers(3, 259, (rows, length)).astype(np.int32)
    batch = {"decoder_target_tokens": tokens, "decoder_input_tokens": tokens,
             "decoder_loss_weights": np.ones_like(tokens),
             "decoder_segment_ids": np.ones_like(tokens),
             "decoder_positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)}
    return jax.device_put({k: batch[k] for k in shapes}, sharding)


def step_seconds(one, steps: int) -> dict:
    """The fastest of `steps` steps in wall time (the one least disturbed by other jobs on a
    shared machine), the median, and the fastest in this process's CPU time (all threads)."""
    import jax

    jax.block_until_ready(one())  # compiled, warm
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(one())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"step_s": min(wall), "median_step_s": statistics.median(wall), "cpu_s": min(cpu)}


def run_mode(mode: str, experiment: str, base_dir: Path, steps: int, tpu: str | None) -> dict:
    import jax

    from capibara_exp.runtime import state as run_state

    bindings, state, axes = build(mode, experiment, base_dir, tpu)
    if mode == "base":
        return {}
    model, data_cfg = bindings["model"], bindings["train_dataset_cfg"]
    trainer = run_state.make_trainer(bindings["trainer_cls"], model, bindings["partitioner"],
                                     state, axes, jax.random.PRNGKey(1), data_cfg.batch_size,
                                     None)
    part = trainer.partitioner
    shapes = run_state.batch_shapes(data_cfg, model)
    out = {"state_bytes": device_bytes(jax.eval_shape(lambda: state), trainer.state_shardings)}
    if trainer.frozen is not None:
        out["base_bytes"] = device_bytes(trainer.frozen.shapes,
                                         part.shardings(trainer.frozen.axes))
    if mode == "frozen_fwd_bwd":
        step, step_args = frozen_fwd_bwd(model, state.params, axes.params, part)
        with part.activation_context():
            compiled = step.lower(*jax.eval_shape(lambda: step_args), shapes).compile()
    else:
        compiled = trainer.lower_train_step(jax.eval_shape(lambda: state), shapes).compile()
    out.update(memory(compiled))
    if tpu:
        return out
    batch = fixed_batch(shapes, part.data_sharding())
    if mode == "frozen_fwd_bwd":
        def one():
            with part.activation_context():
                return step(*step_args, batch)
    else:
        state = trainer.prepare_state(state)

        def one():
            nonlocal state
            state, metrics = trainer.train_step(state, batch)
            return metrics
    out.update(step_seconds(one, steps),
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def in_process(*args: str) -> dict:
    """A worker's report; a failed worker's is {'error': its last line} (e.g. out of HBM)."""
    done = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True,
                          text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["no output"]
        print(f"worker {' '.join(args)} failed: {lines[-1]}", file=sys.stderr)
        return {"error": lines[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the three parts --------------------------------------------------------------------

def cpu_part(tmp: Path, rounds: int, steps: int) -> dict:
    for model in CPU_MODELS:
        in_process("base", model, str(tmp / model), "0")
    results: dict = {m: {} for m in CPU_MODELS}
    for _ in range(rounds):  # the modes take turns, so load from other jobs hits them alike
        for model in CPU_MODELS:
            for mode in MODES:
                got = in_process(mode, model, str(tmp / model), str(steps))
                best = results[model].get(mode)
                if best is None or got.get("step_s", 1e9) < best.get("step_s", 1e9):
                    results[model][mode] = got
    return results


def tpu_part(tmp: Path) -> dict:
    return {mode: in_process(mode, "moe_e2b_base", str(tmp / "unread"), "0", "--tpu", "v5e-8")
            for mode in ("full", "lora", "qlora")}


def quality_part(tmp: Path, data_dir: str, pretrain: int, finetune: int) -> dict:
    from capibara_exp import experiment
    from capibara_exp.runtime import gin_utils
    from capibara_exp.runtime.metrics import last_metrics

    def run(model_dir: Path, steps: int, *overrides: str) -> float:
        cfg = compose(["experiment=moe_e2b_tiny", f"model_dir={model_dir}",
                       f"data_dir={data_dir}", f"trainer.train_steps={steps}",
                       f"trainer.eval_period={steps}", f"checkpoint.checkpoint_period={steps}",
                       *overrides])
        # the data it reads built first, as a run builds them (tasks only read)
        gin_utils.run_train(experiment.write_gin(cfg, model_dir, {},
                                                 lambda: experiment.prepare_data(cfg)))
        return last_metrics(model_dir, "train_eval")["loss"]

    import os

    os.environ["CAPIBARA_DATA_DIR"] = data_dir
    base = tmp / "quality_base"
    losses = {"base": run(base, pretrain)}
    for name, extra in (("lora", ["lora=all"]), ("qlora", ["lora=all", "lora.quantize_base=nf4"])):
        losses[name] = run(tmp / f"quality_{name}", finetune, *extra,
                           f"lora.base_checkpoint={base}")
    return losses


def mib(n: float) -> str:
    return f"{n / 2**20:9.2f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report_cpu(cpu: dict, args) -> None:
    for model, modes in cpu.items():
        if any("error" in r for r in modes.values()):
            print(f"\n{model}: " + "; ".join(f"{m}: {r['error']}" for m, r in modes.items()
                                             if "error" in r))
            continue
        ref = modes["frozen_fwd_bwd"]["step_s"]
        print(f"\n{model} on this CPU: fastest of {args.steps} steps, best of {args.rounds} "
              "rounds (median and CPU time of the same process beside it)")
        print("mode            ms/step  x frozen fwd+bwd  median ms  CPU ms  state MiB  base MiB"
              "  XLA step MiB  peak RSS MiB")
        for mode, r in modes.items():
            state = "        -" if mode == "frozen_fwd_bwd" else mib(r["state_bytes"])
            print(f"{mode:14s} {r['step_s'] * 1e3:8.2f}  {r['step_s'] / ref:16.3f} "
                  f"{r['median_step_s'] * 1e3:10.2f} {r['cpu_s'] * 1e3:7.1f} {state} "
                  f"{mib(r.get('base_bytes', 0))} {mib(r['step_bytes'])}     "
                  f"{mib(r['peak_rss_bytes'])}")
        # On a shared machine either clock can be distorted: wall time by other jobs, CPU time
        # by threads waiting busily; the verdict takes the worse of the two ratios.
        ratio = modes["lora"]["step_s"] / ref
        cpu_ratio = modes["lora"]["cpu_s"] / modes["frozen_fwd_bwd"]["cpu_s"]
        print(f"GOAL LoRA step <= 1.1 x frozen forward+backward: {ratio:.3f} wall, "
              f"{cpu_ratio:.3f} CPU time  {verdict(max(ratio, cpu_ratio) <= 1.1)}")
        share = modes["qlora"]["base_bytes"] / modes["full"]["state_bytes"]
        print(f"     QLoRA base / full fine-tune params+optimizer: {share:.1%} (f32 compute; "
              "int4 codes take a byte each on the CPU)")


def report_tpu(tpu: dict) -> None:
    print("\nmoe_e2b_base, AOT for TPU v5e-8 (bf16 compute, expert=8, batch 16 x 2048), per chip")
    print("mode      state MiB   base MiB  XLA args MiB  XLA temp MiB  XLA step MiB")
    for mode, r in tpu.items():
        if "error" in r:
            print(f"{mode:6s} {r['error'][:160]}")
            continue
        print(f"{mode:6s} {mib(r['state_bytes'])} {mib(r.get('base_bytes', 0))} "
              f"{mib(r['argument_bytes'])}     {mib(r['temp_bytes'])}     "
              f"{mib(r['step_bytes'])}")
    if "base_bytes" in tpu["qlora"] and "state_bytes" in tpu["full"]:
        share = tpu["qlora"]["base_bytes"] / tpu["full"]["state_bytes"]
        print(f"GOAL QLoRA base <= 30% of the bf16 full fine-tune's params + optimizer state: "
              f"{share:.1%}  {verdict(share <= 0.30)}")


def report_quality(quality: dict, args) -> None:
    gap = abs(quality["qlora"] - quality["lora"]) / quality["lora"]
    print(f"\nmoe_e2b_tiny on the routing mixture: pretrained {args.pretrain_steps} steps, "
          f"eval loss {quality['base']:.4f}; after {args.finetune_steps} steps (lora=all): "
          f"LoRA {quality['lora']:.4f}, QLoRA nf4 {quality['qlora']:.4f}")
    print(f"GOAL QLoRA eval loss within 2% of LoRA's: {gap:.2%}  {verdict(gap <= 0.02)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--tpu", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--data-dir", default="data", help="where the routing data is built")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-tpu", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    if args.worker:
        mode, experiment, base_dir, steps = args.worker
        print(json.dumps(run_mode(mode, experiment, Path(base_dir), int(steps), args.tpu)))
        return
    with tempfile.TemporaryDirectory() as tmp:  # each part prints as soon as it is done
        tmp = Path(tmp)
        if not args.skip_cpu:
            report_cpu(cpu_part(tmp, args.rounds, args.steps), args)
        if not args.skip_tpu:
            report_tpu(tpu_part(tmp))
        if not args.skip_quality:
            report_quality(quality_part(tmp, str(Path(args.data_dir).absolute()),
                                        args.pretrain_steps, args.finetune_steps), args)


if __name__ == "__main__":
    main()
