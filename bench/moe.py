"""MoE vs dense step time and FLOP utilisation at equal active parameters; 8 devices vs 1;
microbatching overhead. All three sets of ratios in one run.

Dense: a decoder with MLP width F in every layer. MoE: the same decoder with every second
MLP replaced by E experts of width F and top-1 routing, so each token meets the same
parameters (equal active parameters) while the MoE holds E times the MLP weights there.
Each model trains through the local runtime's Trainer and partitioner:
  - on 1 device, and
  - on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8):
    dense on an 8 x 1 data x model mesh, MoE on 2 x 4 x 1 data x expert x model.
Each device count runs in its own subprocess (XLA_FLAGS is read once at JAX start-up); the
parent alternates them for --rounds rounds and prints medians and ratios. Within a process
the two models step in turn, so load from other jobs hits both alike. Utilisation =
XLA-counted FLOPs per step / step time / this CPU's f32 matmul peak measured in the same
process. On one CPU the 8 simulated devices share its cores: "8 vs 1" shows partitioning
overhead and XLA's different CPU threading, not a multi-chip speed-up.
The 1-device process then times both models at num_microbatches 1, 2 and 4 (same global
batch) with bench/microbatch.py's interleaved timing, and prints each setting's ratio to 1.

    python bench/moe.py [--steps 15] [--rounds 2] [--batch 16] [--length 128]
                        [--mb-rounds 3] [--mb-steps 4]   (--mb-rounds 0: no microbatching)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def build(kind: str, devices: int):
    """(model, partitioner, trainer class, extra trainer args) for 'dense' or 'moe'."""
    import optax
    import seqio

    from capibara_exp.nets import Decoder, DecoderConfig, MoeConfig, MoeDecoder
    from capibara_exp.runtime import contrib_moe, models, optimizers, partitioning
    from capibara_exp.runtime.trainer import Trainer

    cfg = DecoderConfig(vocab_size=260, emb_dim=128, num_heads=4, head_dim=32, num_layers=4,
                        mlp_dim=512)
    opt, vocab = optimizers.OptaxWrapper(optax.adam(1e-3)), seqio.ByteVocabulary()
    if kind == "dense":
        return models.DecoderOnlyModel(Decoder(cfg), vocab, opt), partitioning.PjitPartitioner(), \
            Trainer, {}
    net = MoeDecoder(cfg, MoeConfig(num_experts=4, num_selected_experts=1, capacity_factor=1.25))
    expert_parts = 4 if devices >= 4 else 1
    return (contrib_moe.MoeDecoderOnlyModel(net, vocab, opt, aux_loss_factor=0.01),
            contrib_moe.MoePjitPartitioner(num_expert_partitions=expert_parts),
            contrib_moe.MoeTrainer,
            {"num_expert_partitions": expert_parts})


def make_trainer(kind: str, devices: int, batch_size: int, length: int,
                 num_microbatches: int | None = None):
    """(trainer, state on its devices) of one model."""
    import jax

    from capibara_exp.runtime.state import initial_state

    model, partitioner, trainer_cls, extra = build(kind, devices)
    state, axes = initial_state(model, jax.random.PRNGKey(0), batch_size, length)
    trainer = trainer_cls(
        model=model, train_state=state, partitioner=partitioner, eval_names=[],
        summary_dir=None, train_state_axes=axes, rng=jax.random.PRNGKey(1),
        learning_rate_fn=lambda step: 1e-3, num_microbatches=num_microbatches, **extra)
    trainer.check_batch_size(batch_size)
    return trainer, jax.device_put(state, trainer.state_shardings)


class Runner:
    """One model's trainer, state and device batch, stepped on demand."""

    def __init__(self, kind: str, devices: int, batch_size: int, length: int):
        import jax
        import numpy as np

        self.trainer, self.state = make_trainer(kind, devices, batch_size, length)
        partitioner = self.trainer.partitioner
        tokens = np.random.default_rng(0).integers(3, 259, (batch_size, length)).astype(np.int32)
        self.batch = jax.device_put(
            {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
             "decoder_loss_weights": np.ones_like(tokens, np.float32)},
            partitioner.data_sharding())
        with partitioner.activation_context():
            lowered = self.trainer.lower_train_step(self.state, self.batch)
            cost = lowered.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        params = self.state.params
        total = sum(x.size for x in jax.tree.leaves(params))
        experts = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                      if "expert" in jax.tree_util.keystr(p))
        num_experts = 4 if kind == "moe" else 1
        self.info = {"xla_flops": float(cost.get("flops", 0.0)), "params": total,
                     "active_params": total - experts + experts // num_experts,
                     "tokens": batch_size * length}
        self.times: list[float] = []
        for _ in range(2):  # compile and warm up
            self.step(record=False)

    def step(self, record: bool = True) -> None:
        import jax

        t0 = time.perf_counter()
        self.state, metrics = self.trainer.train_step(self.state, self.batch)
        jax.block_until_ready(metrics)
        if record:
            self.times.append(time.perf_counter() - t0)

    def result(self) -> dict:
        step_s = statistics.median(self.times)
        return dict(self.info, step_s=step_s, tokens_per_s=self.info["tokens"] / step_s)


def child(args: argparse.Namespace) -> None:
    import jax

    from capibara_exp.runtime.metrics import matmul_peak_flops

    devices = jax.device_count()
    runners = {kind: Runner(kind, devices, args.batch, args.length) for kind in ("dense", "moe")}
    for _ in range(args.steps):  # interleaved, so load from elsewhere hits both alike
        for runner in runners.values():
            runner.step()
    out = {"devices": devices, "peak_flops": matmul_peak_flops()}
    out.update({kind: runner.result() for kind, runner in runners.items()})
    if devices == 1 and args.mb_rounds:
        out["microbatch"] = microbatch_times(runners, args)
    print(json.dumps(out))


def microbatch_times(runners: dict, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per model, num_microbatches -> median seconds per step (bench/microbatch.py's timing)."""
    from microbatch import time_settings  # sibling script: bench/ is the script dir on sys.path

    out = {}
    for kind, runner in runners.items():
        del runner.state  # the timed states of the first part are done with
        times = time_settings(
            lambda n, kind=kind: make_trainer(kind, 1, args.batch, args.length, n),
            runner.batch, args.mb_rounds, args.mb_steps)
        out[kind] = {str(n): statistics.median(t) for n, t in times.items()}
    return out


def run_child(devices: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--batch",
           str(args.batch), "--length", str(args.length), "--mb-rounds", str(args.mb_rounds),
           "--mb-steps", str(args.mb_steps)]
    out = subprocess.run(cmd, env=env, text=True, capture_output=True, check=False)
    if out.returncode:
        sys.exit(f"bench/moe.py: the {devices}-device run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(runs: dict[int, dict]) -> None:
    print(f"{'devices':>7} {'model':>5} {'params':>9} {'active':>9} {'step ms':>8} "
          f"{'tok/s':>8} {'XLA GFLOP':>9} {'util':>6}")
    for devices, r in runs.items():
        for kind in ("dense", "moe"):
            m = r[kind]
            util = m["xla_flops"] * devices / m["step_s"] / r["peak_flops"]
            print(f"{devices:>7} {kind:>5} {m['params']:>9,} {m['active_params']:>9,} "
                  f"{m['step_s'] * 1e3:>8.1f} {m['tokens_per_s']:>8.0f} "
                  f"{m['xla_flops'] * devices / 1e9:>9.2f} {util:>6.1%}")
    print("peak f32 matmul: " + ", ".join(f"{d} dev {r['peak_flops'] / 1e9:.0f} GFLOP/s"
                                         for d, r in runs.items()))
    one, eight = runs[1], runs[8]
    print(f"MoE / dense step time, 1 device:  {one['moe']['step_s'] / one['dense']['step_s']:.2f}")
    print(f"MoE / dense step time, 8 devices: "
          f"{eight['moe']['step_s'] / eight['dense']['step_s']:.2f}")
    for kind in ("dense", "moe"):
        print(f"{kind} 8 devices / 1 device step time: "
              f"{eight[kind]['step_s'] / one[kind]['step_s']:.2f}")
    for kind, times in one.get("microbatch", {}).items():
        print(f"{kind} microbatching, step time / num_microbatches=1 (1 device): " + ", ".join(
            f"{n} -> {t / times['1']:.2f} ({t * 1e3:.0f} ms)" for n, t in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternate 1- and 8-device processes this many times")
    parser.add_argument("--mb-rounds", type=int, default=3,
                        help="microbatching: timed rounds per setting (0: skip)")
    parser.add_argument("--mb-steps", type=int, default=4, help="microbatching: steps per round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rounds = [{devices: run_child(devices, args) for devices in (1, 8)}
              for _ in range(args.rounds)]
    report({devices: median_run([r[devices] for r in rounds]) for devices in (1, 8)})


def median_run(runs: list[dict]) -> dict:
    """Per-figure medians over rounds: load from other jobs drifts between processes."""
    out = dict(runs[0], peak_flops=statistics.median(r["peak_flops"] for r in runs))
    for kind in ("dense", "moe"):
        step_s = statistics.median(r[kind]["step_s"] for r in runs)
        out[kind] = dict(runs[0][kind], step_s=step_s,
                         tokens_per_s=runs[0][kind]["tokens"] / step_s)
    if "microbatch" in runs[0]:
        out["microbatch"] = {
            kind: {n: statistics.median(r["microbatch"][kind][n] for r in runs) for n in times}
            for kind, times in runs[0]["microbatch"].items()}
    return out


if __name__ == "__main__":
    main()
