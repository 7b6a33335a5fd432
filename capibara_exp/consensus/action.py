"""T5X actions (TRAIN_EVAL) for consensus merging, the same class names under both engines.

`ChecksumCheckpoints` writes a checksum manifest into every finished checkpoint of the
model dir that lacks one. The local engine's checkpoints.save writes manifests itself;
real T5X writes none, so this action gives its checkpoints one soon after they are
written (T5X runs TRAIN_EVAL actions after each train-eval pass; on the final epoch
after the checkpoint is saved), and a later merge can verify them under either engine.

`ConsensusMerge` does the same on every call and, once, at the first call with
step >= total_steps (T5X has no end-of-training mode), merges the run's last K
checkpoints into model_dir/merged.

Both implement T5X's `BaseAction.run(train_state, metrics_by_task)` and read only
`train_state.step`, so real T5X runs them too; the gin body binds them identically
for both engines (gin/consensus/).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capibara_exp.runtime.trainer import BaseAction

MERGED_SUBDIR = "merged"


def write_missing_manifests(model_dir: str | Path) -> list[Path]:
    """A manifest for each finished checkpoint_<step> of model_dir without one; returns them.

    Orbax writes a checkpoint under a temporary name and renames it when complete, so a
    step dir that `checkpoints.steps` lists is finished. One deleted meanwhile (the
    manager keeps only so many) is skipped."""
    import jax

    from capibara_exp.runtime import checkpoints, integrity

    if jax.process_index() != 0:
        return []
    written = []
    for step in checkpoints.steps(model_dir):
        step_dir = Path(model_dir) / f"{checkpoints.STEP_PREFIX}_{step}"
        if (step_dir / integrity.MANIFEST).is_file():
            continue
        try:
            written.append(integrity.write_manifest(step_dir, step=step, kind="action"))
        except FileNotFoundError:
            if step_dir.exists():
                raise
    return written


class ChecksumCheckpoints(BaseAction):
    """Give every finished checkpoint of model_dir a checksum manifest (never stops training)."""

    def __init__(self, model_dir: str):
        self.model_dir = Path(model_dir)
        self.manifests_written: list[Path] = []

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Any]) -> bool:
        self.manifests_written += write_missing_manifests(self.model_dir)
        return False


class ConsensusMerge(ChecksumCheckpoints):
    """Checksum new checkpoints; at the end, merge the last `last_k` into model_dir/merged.

    The validation data set gives `eval_steps` selection batches (gate, soups) and the next
    `report_steps` (default eval_steps) held-out batches for the report.
    """

    def __init__(self, model_dir: str, total_steps: int, method: str = "uniform", last_k: int = 3,
                 model: Any = None, eval_dataset_cfg: Any = None, eval_steps: int = 1,
                 report_steps: int | None = None, merge_params: Mapping[str, Any] | None = None,
                 min_pass_fraction: float = 0.5, max_val_loss: float | None = None,
                 max_val_loss_ratio: float | None = 1.5, require_manifest: bool = True,
                 use_ema: bool = True):
        """`merge_params`: the method's parameters by name (composing/merge_methods.py's MergeSpec,
        e.g. {'num_byzantine': 1}); an unknown name or a bad value is an error here, before
        training starts."""
        from capibara_exp.composing.merge_methods import spec_from
        from capibara_exp.consensus.gate import GateConfig

        super().__init__(model_dir)
        if isinstance(last_k, bool) or not isinstance(last_k, int) or last_k < 1:
            raise ValueError(f"consensus.ConsensusMerge.last_k must be an integer >= 1, got "
                             f"{last_k!r}")
        self.total_steps = total_steps
        self.last_k = last_k
        self.spec = spec_from(method, dict(merge_params or {}))
        self.spec.check_candidates(last_k, "checkpoints (last_k)")
        self.gate = GateConfig(require_manifest=require_manifest, max_val_loss=max_val_loss,
                               max_val_loss_ratio=max_val_loss_ratio,
                               min_pass_fraction=min_pass_fraction)
        self.model, self.eval_dataset_cfg = model, eval_dataset_cfg
        self.eval_steps = max(eval_steps, 1)
        self.report_steps = self.eval_steps if report_steps is None else report_steps
        self.use_ema = use_ema  # an EMA run merges its EMA weights (False: the raw ones)
        self.fired_at: int | None = None
        self.report: dict | None = None
        self.events: Any = None  # the local engine's events (runtime/events.py): `merge`

    def bind_events(self, events: Any) -> None:
        self.events = events

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Any]) -> bool:
        super().run(train_state, metrics_by_task)  # the final checkpoint gets its manifest too
        step = int(train_state.step)
        if self.fired_at is not None or step < self.total_steps:
            return False
        self.fired_at = step
        from capibara_exp.consensus import merge_report, store
        from capibara_exp.consensus.merge import merge
        from capibara_exp.consensus.validation import held_out

        evaluator = report_evaluator = None
        if self.model is not None and self.eval_dataset_cfg is not None:
            evaluator, report_evaluator = held_out(self.model, self.eval_dataset_cfg,
                                                   self.eval_steps, self.report_steps)
        candidates = store.last_k(self.model_dir, self.last_k, self.use_ema)
        self.report = merge(candidates, self.spec, self.model_dir / MERGED_SUBDIR, evaluator,
                            self.gate, report_evaluator=report_evaluator)
        for line in merge_report.warning_lines(self.report):
            print(f"capibara-exp consensus merge: {line}", file=sys.stderr)
        if self.events is not None:
            self.events.emit("merge", report=self.report)
        return False  # merging never stops training; it runs after the final step anyway
