"""`ConsensusMerge`: a T5X action (TRAIN_EVAL) that merges the run's last K checkpoints once.

Registered in config.gin as `train_script.train.actions = {'TRAIN_EVAL':
[@consensus.ConsensusMerge()]}` under both engines: it implements T5X's
`BaseAction.run(train_state, metrics_by_task)` and reads only `train_state.step`, so real
T5X runs it too. TRAIN_EVAL actions run after the final checkpoint is written, and T5X
has no end-of-training mode, so it fires at the first call with step >= total_steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capibara_exp.runtime.trainer import BaseAction

MERGED_SUBDIR = "merged"


class ConsensusMerge(BaseAction):
    """Merge the last `last_k` checkpoints of model_dir into model_dir/merged at the end."""

    def __init__(self, model_dir: str, total_steps: int, method: str = "uniform", last_k: int = 3,
                 model: Any = None, eval_dataset_cfg: Any = None, eval_steps: int = 1,
                 num_byzantine: int = 0, weights: Sequence[float] | None = None,
                 min_pass_fraction: float = 0.5, max_val_loss: float | None = None,
                 max_val_loss_ratio: float | None = 1.5, require_manifest: bool = True):
        from capibara_exp.consensus.gate import GateConfig
        from capibara_exp.consensus.merge import MergeSpec

        if last_k < 1:
            raise ValueError(f"consensus.ConsensusMerge.last_k must be >= 1, got {last_k}")
        self.model_dir = Path(model_dir)
        self.total_steps = total_steps
        self.last_k = last_k
        self.spec = MergeSpec(method=method, num_byzantine=num_byzantine,
                              weights=tuple(weights) if weights else None)
        self.gate = GateConfig(require_manifest=require_manifest, max_val_loss=max_val_loss,
                               max_val_loss_ratio=max_val_loss_ratio,
                               min_pass_fraction=min_pass_fraction)
        self.model, self.eval_dataset_cfg, self.eval_steps = model, eval_dataset_cfg, eval_steps
        self.fired_at: int | None = None
        self.report: dict | None = None

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Any]) -> bool:
        step = int(train_state.step)
        if self.fired_at is not None or step < self.total_steps:
            return False
        self.fired_at = step
        from capibara_exp.consensus import store
        from capibara_exp.consensus.evaluate import Evaluator
        from capibara_exp.consensus.merge import merge

        evaluator = None
        if self.model is not None and self.eval_dataset_cfg is not None:
            evaluator = Evaluator(self.model, self.eval_dataset_cfg, max(self.eval_steps, 1))
        candidates = store.last_k(self.model_dir, self.last_k)
        self.report = merge(candidates, self.spec, self.model_dir / MERGED_SUBDIR, evaluator,
                            self.gate)
        return False  # merging never stops training; it runs after the final step anyway
