"""Checkpoint costs, measured in one run against the save itself.

python bench/checkpoint.py [--gb 1.0] [--reps 3] [--loop-mb 256] [--steps 40] [--every 5]

1. Integrity on a --gb state: the time to write the manifest (BLAKE3 of every file), to
   verify it on restore, and to check the state finite before saving (one fused reduction
   on the device), as a share of the Orbax save (write and commit, synchronous). Goal (the
   hashing's cost): manifest + verify < 10% of the save time; PASS/FAIL printed. The finite
   check, the price of never saving NaN, is printed beside it.
2. Checkpointing as a share of step time in a train loop (a jitted, donated step on a
   --loop-mb state, a save every --every steps), synchronous against asynchronous saves
   (Orbax writes while the next steps run), each against the same loop with no saves.
   Each figure is the median of --reps runs, interleaved so the machine's drift hits all.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from capibara_exp.runtime import checkpoints, integrity

GOAL = 0.10


def state_of(gb: float, leaves: int = 16) -> dict:
    """A T5X-like tree of float32 leaves totalling `gb` GB (random: it does not compress)."""
    n = int(gb * 1e9 / 4 / leaves)
    side = int(np.sqrt(n))
    keys = jax.random.split(jax.random.PRNGKey(0), leaves)
    return {"target": {f"w{i}": jax.random.normal(k, (side, side)) for i, k in enumerate(keys)},
            "state": {"step": jnp.asarray(1, jnp.int32)}}


def orbax_save(directory: Path, step: int, tree: dict) -> float:
    """Seconds of a plain synchronous Orbax save (the manager the runtime uses, no manifest)."""
    options = ocp.CheckpointManagerOptions(step_prefix=checkpoints.STEP_PREFIX, create=True,
                                           enable_async_checkpointing=False)
    with ocp.CheckpointManager(directory, options=options, item_handlers={
            checkpoints.ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=True)}) as mgr:
        t0 = time.perf_counter()
        mgr.save(step, args=ocp.args.Composite(**{checkpoints.ITEM: ocp.args.PyTreeSave(tree)}),
                 force=True)
        mgr.wait_until_finished()
        return time.perf_counter() - t0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def integrity_overhead(gb: float, reps: int, root: Path) -> bool:
    tree = state_of(gb)
    jax.block_until_ready(tree)
    checkpoints.all_finite(tree)  # compile the reduction once
    rows = []
    for rep in range(reps):
        save_s = orbax_save(root / f"i{rep}", 1, tree)
        step_dir = checkpoints.step_dir(root / f"i{rep}", 1)
        finite_s = timed(lambda: checkpoints.all_finite(tree))
        manifest_s = timed(lambda step_dir=step_dir: integrity.write_manifest(step_dir))
        verify_s = timed(lambda step_dir=step_dir: integrity.verify_checkpoint(step_dir))
        rows.append((save_s, finite_s, manifest_s, verify_s))
    save_s, finite_s, manifest_s, verify_s = (statistics.median(c) for c in zip(*rows, strict=True))
    share = (manifest_s + verify_s) / save_s
    size = sum(p.stat().st_size for p in (root / "i0").rglob("*") if p.is_file()) / 1e9
    print(f"1. integrity on a {gb:.2f} GB state ({size:.2f} GB on disk), median of {reps}:")
    print(f"   Orbax save (write + commit)   {save_s:7.2f} s")
    print(f"   finite check (on device)      {finite_s:7.3f} s  {finite_s / save_s:6.1%}")
    print(f"   manifest (BLAKE3 of files)    {manifest_s:7.3f} s  {manifest_s / save_s:6.1%}")
    print(f"   verify on restore             {verify_s:7.3f} s  {verify_s / save_s:6.1%}")
    ok = share < GOAL
    print(f"   hashing: manifest + verify    {share:6.1%} of the save  (goal < {GOAL:.0%}: "
          f"{'PASS' if ok else 'FAIL'})")
    print(f"   with the finite check too     {share + finite_s / save_s:6.1%} of the save")
    return ok


@jax.jit
def _work(x: jax.Array) -> jax.Array:
    """A step's worth of compute on one leaf: a few matmuls on a slice, a full update."""
    head = x[:512, :512]
    for _ in range(6):
        head = jnp.tanh(head @ head.T) * 0.5
    return x * 0.999 + 0.001 * jnp.mean(head)


def loop_seconds(state: dict, steps: int, every: int, saver: checkpoints.Checkpointer | None
                 ) -> float:
    step_fn = jax.jit(lambda s: jax.tree.map(_work, s), donate_argnums=(0,))
    state = jax.tree.map(jnp.copy, state)
    state = step_fn(state)  # compiled outside the timing
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        state = step_fn(state)
        if saver is not None and step % every == 0:
            saver.save(step, {"target": state}, "periodic", wait=False)
    jax.block_until_ready(state)
    if saver is not None:
        saver.wait()
    return time.perf_counter() - t0


def step_share(mb: int, steps: int, every: int, reps: int, root: Path) -> None:
    state = state_of(mb / 1e3)["target"]
    jax.block_until_ready(state)
    runs: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    for rep in range(reps):
        for kind in runs:
            saver = None if kind == "none" else checkpoints.manager(
                root / f"{kind}{rep}", keep=2, async_save=kind == "async")
            runs[kind].append(loop_seconds(state, steps, every, saver))
            if saver is not None:
                saver.close()
    base = statistics.median(runs["none"])
    print(f"2. checkpointing in a train loop: {mb} MB state, {steps} steps "
          f"({base / steps * 1e3:.0f} ms each), a save every {every}, median of {reps}:")
    for kind in ("sync", "async"):
        t = statistics.median(runs[kind])
        print(f"   {kind:5s} saves: {t:6.2f} s vs {base:6.2f} s with none: checkpointing is "
              f"{(t - base) / t:6.1%} of the loop's time ({(t - base) / base:+.1%} on it)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop-mb", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        ok = integrity_overhead(args.gb, args.reps, Path(tmp))
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        step_share(args.loop_mb, args.steps, args.every, args.reps, Path(tmp))
    print(f"goal: {'PASS' if ok else 'FAIL'} (hashing, manifest + verify, < {GOAL:.0%} of the "
          "save)")


if __name__ == "__main__":
    main()
