"""Sweep speed: compile reuse across in-process trials, and trial-steps saved by pruning.

    python bench/sweep_speed.py [--trials 8] [--steps 20] [--part all|speed|pruning]
                                [--warmup 0.5]

One learning-rate sweep of the tiny model, run three ways in this one run:
  reuse     the capibara_optuna sweeper, trials in one process sharing XLA's compilation
            cache (the learning rate is optimizer state, so every trial's step is one program)
  no_reuse  the same sweep with hydra.sweeper.compile_cache=false: each trial compiles
  fresh     the same learning rates, each trial its own `capibara-exp` process, as
            process-based launchers (submitit and the like) run them
and then the same random-sampled sweep with and without a median pruner (which leaves the
first --warmup share of each trial's steps alone: low learning rates start slow), counting
the training steps run and the best value found. Prints wall-time ratios against `reuse`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
LR = "schedule.base_learning_rate"


def cli(*args: str) -> float:
    """Run capibara-exp with args; its wall time in seconds."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", *args], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"capibara-exp {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - start


def sweep(sweep_dir: Path, common: list[str], trials: int,
          *extra: str) -> tuple[float, optuna.Study]:
    seconds = cli("-m", "hydra/sweeper=capibara_optuna", f"hydra.sweeper.n_trials={trials}",
                  "hydra.sweeper.sampler=random", "hydra.sweeper.seed=0",
                  f"hydra.sweep.dir={sweep_dir}", f"{LR}=tag(log, interval(1e-3, 1e-2))",
                  *common, *extra)
    study = optuna.load_study(study_name="dense_tiny_lm",
                              storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    return seconds, study


def steps_run(study: optuna.Study, total: int) -> int:
    return sum(max(t.intermediate_values, default=total) for t in study.trials)


def speed(work: Path, common: list[str], trials: int, steps: int) -> None:
    reuse_s, study = sweep(work / "reuse", common, trials)
    no_reuse_s, _ = sweep(work / "no_reuse", common, trials, "hydra.sweeper.compile_cache=false")
    lrs = [t.params[LR] for t in study.trials]
    fresh_s = sum(cli(*common, f"{LR}={lr!r}", f"hydra.run.dir={work / 'fresh' / str(i)}")
                  for i, lr in enumerate(lrs))
    programs = len(list((work / "reuse" / "xla_cache").glob("jit__step-*")))
    print(f"{trials}-trial learning-rate sweep, {steps} steps per trial (tiny dense model)")
    print(f"  in-process, compile reuse : {reuse_s:7.1f} s  ({programs} train-step program(s) "
          f"compiled for {trials} learning rates)")
    print(f"  in-process, no reuse      : {no_reuse_s:7.1f} s  = {no_reuse_s / reuse_s:.2f}x reuse")
    print(f"  fresh process per trial   : {fresh_s:7.1f} s  = {fresh_s / reuse_s:.2f}x reuse "
          f"(goal >= 3x)")
    print(f"  goal met: {'yes' if fresh_s / reuse_s >= 3 else 'NO'} (in-process with reuse is "
          f"{fresh_s / reuse_s:.2f}x faster than a fresh process per trial)")


def pruning(work: Path, data: str, trials: int, steps: int, warmup: float) -> None:
    """The same random-sampled sweep of 4x longer trials with and without a median pruner
    that leaves each trial's first `warmup` share of steps alone."""
    long, period = 4 * steps, steps // 4 or 1
    pcommon = [data, f"trainer.train_steps={long}", f"trainer.eval_period={period}",
               f"checkpoint.checkpoint_period={long}", "trainer.eval_steps=2"]
    warmup_steps = int(warmup * long)
    _, plain = sweep(work / "no_pruning", pcommon, trials)
    _, pruned = sweep(work / "median", pcommon, trials, "hydra.sweeper.pruner=median",
                      f"hydra.sweeper.pruner_options={{n_warmup_steps:{warmup_steps}}}")
    full, cut = trials * long, steps_run(pruned, long)
    print(f"{trials}-trial sweep of {long} steps per trial, evaluated every {period}:")
    print(f"  no pruning    : {full} trial-steps, best eval loss {plain.best_value:.4f}")
    print(f"  median pruner (n_warmup_steps={warmup_steps}): {cut} trial-steps "
          f"({1 - cut / full:.0%} saved), best eval loss {pruned.best_value:.4f}, "
          f"{sum(t.state.name == 'PRUNED' for t in pruned.trials)} trials pruned")
    same = plain.best_trial.params == pruned.best_trial.params
    print(f"  same best trial with and without pruning: {'yes' if same else 'NO'} "
          f"(best value {pruned.best_value - plain.best_value:+.4f} with pruning)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--part", choices=("all", "speed", "pruning"), default="all")
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="share of a trial's steps before the pruner may stop it")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="capibara-bench-sweep-"))
    s = args.steps
    common = [f"data_dir={work / 'data'}", f"trainer.train_steps={s}", f"trainer.eval_period={s}",
              f"checkpoint.checkpoint_period={s}", "trainer.eval_steps=2"]
    cli(*common, f"hydra.run.dir={work / 'warmup'}")  # builds the data set; not timed
    if args.part in ("all", "speed"):
        speed(work, common, args.trials, s)
    if args.part in ("all", "pruning"):
        pruning(work, common[0], args.trials, s, args.warmup)
    print(f"(work dir {work})")


if __name__ == "__main__":
    main()
