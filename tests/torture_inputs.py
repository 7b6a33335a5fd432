"""The torture's bad inputs (tests/torture.py runs them): poisoned and absurd merge
parameters, poisoned merge candidates, and sizes that cannot fit."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from capibara_exp.runtime import checkpoints, integrity
from tests.torture import RUN, STEPS, Tally, nonfinite_checkpoints, tree

# ---- poisoned and absurd merge parameters ---------------------------------------------------

# A value no merge may take is refused when the command line is checked, before any read
# ("KEY=VALUE (set by the command line): expected ..."); what depends on the candidates or
# on another key is refused by the merge itself.
SET = "(set by the command line): expected"
BAD_MERGES = [
    (["method=weighted", "weights=[inf,1,1]"], f"weights=[inf, 1, 1] {SET} a list of finite"),
    (["method=weighted", "weights=[-1,1,1]"], f"weights=[-1, 1, 1] {SET} a list of numbers >= 0"),
    (["method=task_arithmetic", "scale=nan", "base=BASE"], f"scale=nan {SET} a finite number"),
    (["method=task_arithmetic", "scale=1e300", "base=BASE"], "merged state not written"),
    (["method=fedavg", "fedavg.num_clients=0", "runs=RUN0"],
     f"fedavg.num_clients=0 {SET} an integer >= 1"),
    (["method=fedavg", "fedavg.noise_multiplier=-1", "runs=RUN0"],
     f"fedavg.noise_multiplier=-1 {SET} a number >= 0"),
    (["last_k=0", "runs=RUN0"], f"last_k=0 {SET} an integer >= 1"),
    (["method=multi_krum", "num_selected=0"], f"num_selected=0 {SET} an integer >= 1"),
    (["method=multi_krum", "num_selected=9"], "num_selected=9 must be in [1, n - f]"),
    (["method=trimmed_mean", "num_byzantine=2"], "needs at least 5 candidates (n > 2f)"),
    (["method=krum", "num_byzantine=1"], "needs at least 5 candidates (n > 2f + 2)"),
    (["method=median", "num_byzantine=-1"], f"num_byzantine=-1 {SET} an integer >= 0"),
    (["method=median", "scale=2.0"], "scale=2.0 is not a parameter of method=median"),
    (["runs=[]"], "runs=[]: name at least one"),
    (["method=soup"], f"method=soup {SET} one of uniform"),
    (["method=ties", "density=0", "base=BASE"], f"density=0 {SET} in (0, 1]"),
    (["method=learned", "learn_steps=0"], f"learn_steps=0 {SET} an integer >= 1"),
    (["gate.min_pass_fraction=2"], f"gate.min_pass_fraction=2 {SET} a number >= 0 and <= 1"),
    (["gate.max_distance_ratio=nan"], f"gate.max_distance_ratio=nan {SET} a number > 0"),
]


def merge_trials(root: Path, reference: Path, tally: Tally, console: bool) -> None:
    """Each bad parameter: exit 2 with one line naming it, and nothing written. `console`
    runs capibara-exp-merge itself (slow); else its work, in this process."""
    runs = [checkpoints.step_dir(reference, s) for s in (STEPS - 4, STEPS - 2, STEPS)]
    base = checkpoints.step_dir(reference, 2)
    for overrides, message in BAD_MERGES:
        out = root / f"merge{len(tally.results.get('bad merge parameter', []))}"
        given = [a.replace("BASE", str(base)).replace("RUN0", str(reference)) for a in overrides]
        args = [*([] if any(a.startswith("runs=") for a in given) else
                  [f"runs=[{','.join(map(str, runs))}]"]),
                f"out={out}", *given, "gate.max_val_loss_ratio=null"]
        code, text = _merge_cli(args) if console else _merge_here(args)
        lines = [line for line in text.splitlines() if line.startswith("capibara-exp-merge:")]
        ok = code == 2 and len(lines) == 1 and message in lines[0] and not checkpoints.steps(out)
        tally.record("bad merge parameter", ok, f"{' '.join(overrides)} -> exit {code}: "
                     + (lines[0][:150] if lines else text[-200:]))


def _merge_cli(args: list[str]) -> tuple[int, str]:
    script = Path(sys.executable).parent / "capibara-exp-merge"
    done = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=600)
    return done.returncode, done.stderr


def _merge_here(args: list[str]) -> tuple[int, str]:
    """capibara-exp-merge's command-line check, composition and work in this process, with
    its error handling."""
    from hydra import compose, initialize_config_dir

    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.cli.common import checked_argv, user_errors
    from capibara_exp.consensus import merge_command
    from capibara_exp.consensus.gate import ConsensusError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _, _, args = checked_argv("capibara-exp-merge", "merge", args)
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("merge", overrides=args)
        with contextlib.redirect_stderr(err), user_errors("capibara-exp-merge", ConsensusError,
                                                          ValueError, FileNotFoundError):
            rep = merge_command.run_merge(cfg)
    except SystemExit as exit_:
        return int(exit_.code), err.getvalue()
    return 0, err.getvalue() + "".join(f"capibara-exp-merge: {line}\n"
                                       for line in merge_command.console_lines(rep))


def poisoned_candidates(root: Path, reference: Path, tally: Tally) -> None:
    """A NaN candidate and a 1e6x one among honest ones: the gate names both on the console
    and the merged state is finite."""
    import orbax.checkpoint as ocp

    honest = [checkpoints.step_dir(reference, s) for s in (STEPS - 4, STEPS - 2, STEPS)]
    foreign = root / "foreign"
    for name, factor in (("nan", np.nan), ("huge", 1e6)):
        t = jax.tree.map(lambda x, f=factor: x * f if np.issubdtype(np.asarray(x).dtype,
                                                                     np.floating) else x,
                         tree(honest[-1]))
        options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True,
                                               enable_async_checkpointing=False)
        with ocp.CheckpointManager((foreign / name).absolute(), options=options, item_handlers={
                "state": ocp.PyTreeCheckpointHandler(use_ocdbt=True)}) as mgr:
            mgr.save(STEPS, args=ocp.args.Composite(state=ocp.args.PyTreeSave(t)), force=True)
        integrity.write_manifest(checkpoints.step_dir(foreign / name, STEPS))
    out = root / "merged"
    everyone = ",".join(map(str, [*honest, foreign / "nan", foreign / "huge"]))
    code, text = _merge_here([f"runs=[{everyone}]", f"out={out}", "method=uniform",
                              "gate.max_val_loss_ratio=null"])
    named = all(re.search(rf"rejected {n}/checkpoint_{STEPS}: ", text) for n in ("nan", "huge"))
    ok = code == 0 and named and not nonfinite_checkpoints(out)
    tally.record("poisoned candidates named", ok, " | ".join(
        line for line in text.splitlines() if "rejected" in line)[:200])


# ---- absurd sizes ----------------------------------------------------------------------------

ABSURD = [  # a float where an integer belongs is refused on the command line; then estimates
    ("data.batch_size=1e9", "data.batch_size=1000000000.0 (set by the command line): expected "
     "an integer >= 1"),
    ("model.num_layers=1e5", "model.num_layers=100000.0 (set by the command line): expected "
     "an integer >= 1"),
    ("trainer.eval_steps=1e9", "trainer.eval_steps=1000000000.0 (set by the command line): "
     "expected an integer >= 0"),
    ("data.batch_size=1000000000", "its host batches need about"),
    ("trainer.eval_steps=1000000000", "the eval batches, held in memory"),
    ("model.num_layers=100000", "unrolled (scan_layers=False)"),
    ("model.num_layers=100000 model.scan_layers=true model.emb_dim=4096", "need at least"),
    ("data.batch_size=1024 data.task_feature_lengths={targets:2048}", "the train step needs"),
]


def absurd_trials(root: Path, tally: Tally) -> None:
    """capibara-exp with sizes that cannot fit: exit 2 within a minute, one line naming the
    key, the estimate and the limit, no checkpoint."""
    script = Path(sys.executable).parent / "capibara-exp"
    for i, (override, message) in enumerate(ABSURD):
        model_dir = root / f"absurd{i}"
        t0 = time.perf_counter()
        done = subprocess.run([str(script), *RUN, *override.split(), f"model_dir={model_dir}",
                               f"hydra.run.dir={model_dir}"], capture_output=True, text=True,
                              timeout=600)
        seconds = time.perf_counter() - t0
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("capibara-exp: config")]
        ok = (done.returncode == 2 and len(lines) == 1 and message in lines[0] and seconds < 60
              and not checkpoints.steps(model_dir))
        tally.record("absurd size fails fast", ok, f"{override}: exit {done.returncode} in "
                     f"{seconds:.0f}s: " + (lines[0][-170:] if lines else done.stderr[-200:]))
