"""`SweepSoup`: a Hydra callback that, at the end of a multirun, soups the trials' final
checkpoints into <sweep dir>/merged (the model-soups recipe over a hyperparameter sweep)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

MERGED_SUBDIR = "merged"


def trial_dirs(sweep_dir: Path) -> list[Path]:
    """Subdirs of a sweep dir holding finished checkpoints, in job order."""
    from capibara_exp.runtime import checkpoints

    found = [d for d in sweep_dir.iterdir() if d.is_dir() and checkpoints.steps(d)]
    return sorted(found, key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit()
                                        else 0, d.name))


def soup_sweep(sweep_dir: str | Path, method: str = "greedy_soup", num_byzantine: int = 0,
               min_pass_fraction: float = 0.5, max_val_loss_ratio: float | None = 1.5,
               require_manifest: bool = True, report_batches: int | None = None,
               use_ema: bool = True) -> dict:
    """Merge the latest checkpoint of every trial of a sweep dir; returns the merge report."""
    from capibara_exp.consensus import run, store, validation
    from capibara_exp.consensus.gate import GateConfig
    from capibara_exp.consensus.merge import MergeSpec, merge

    sweep_dir = Path(sweep_dir).absolute()
    trials = trial_dirs(sweep_dir)
    if not trials:
        raise FileNotFoundError(f"{sweep_dir}: no trial dir with finished checkpoints to soup")
    candidates = [store.candidate_from_path(d, name=f"trial {d.name}", use_ema=use_ema)
                  for d in trials]
    evaluator, report_evaluator = validation.from_parts(
        run.load_parts(run.find_config_gin(trials[0])), report_batches=report_batches)
    gate = GateConfig(require_manifest=require_manifest, max_val_loss_ratio=max_val_loss_ratio,
                      min_pass_fraction=min_pass_fraction)
    return merge(candidates, MergeSpec(method=method, num_byzantine=num_byzantine),
                 sweep_dir / MERGED_SUBDIR, evaluator, gate, report_evaluator=report_evaluator)


class SweepSoup(Callback):
    """hydra.callbacks entry (conf/consensus/sweep_soup.yaml); runs in the launching process."""

    def __init__(self, **options: Any):
        self.options = options

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from capibara_exp.consensus import merge_report

        sweep_dir = Path(config.hydra.sweep.dir)
        rep = soup_sweep(sweep_dir, **self.options)
        rows = rep["candidates"]
        # Per-leaf methods (median, ...) have no weights: every accepted trial takes part.
        used = sum(1 for r in rows if r["accepted"] and (r["weight"] is None or r["weight"] > 0))
        passed = sum(r["accepted"] for r in rows)
        loss = rep["held_out_loss"] or rep["val_loss"]
        which = "held-out" if rep["held_out_loss"] else "val"
        print(f"capibara-exp: merged {used} of {len(rows)} trials ({passed} passed the gate) "
              f"into {rep['merged_checkpoint']}: {which} loss {loss['merged']:.4f}, best trial "
              f"{loss['best_candidate']:.4f}", file=sys.stderr)
        for line in merge_report.warning_lines(rep):
            print(f"capibara-exp: {line}", file=sys.stderr)
