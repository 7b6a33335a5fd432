"""T5X's actions in the local engine's loop: which modes run, and running them on every
process alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from capibara_exp.runtime.trainer import BaseAction, TrainState
from capibara_exp.runtime.utils import UnsupportedParameter


def check_actions(actions: Mapping[str, Sequence[BaseAction]] | None,
                  concurrent_metrics: bool, infer_eval: bool = False
                  ) -> dict[str, list[BaseAction]]:
    """T5X's action modes that the local engine runs: TRAIN_EVAL, and TRAIN after each train
    report (T5X runs TRAIN actions only with concurrent_metrics=False and skips them otherwise)."""
    actions = {mode: list(acts) for mode, acts in (actions or {}).items()}
    unknown = set(actions) - {"TRAIN", "TRAIN_EVAL", "INFER_EVAL"}
    if unknown:
        raise ValueError(f"train_script.train.actions: modes {sorted(unknown)} are not T5X's "
                         "action modes (TRAIN, TRAIN_EVAL, INFER_EVAL)")
    if actions.get("INFER_EVAL") and not infer_eval:
        raise UnsupportedParameter(
            "train_script.train.actions['INFER_EVAL'] would never run: no "
            "train_script.train.infer_eval_dataset_cfg (the inference evaluation) is set")
    if actions.get("TRAIN") and concurrent_metrics:
        raise UnsupportedParameter(
            "train_script.train.actions['TRAIN'] needs train_script.train.concurrent_metrics = "
            "False (T5X skips TRAIN actions when metrics are computed concurrently)")
    return actions


def run_actions(actions: Sequence[BaseAction], state: TrainState, metrics: Mapping) -> bool:
    """Actions run on process 0 only (as in T5X); whether one asked to stop reaches every
    process, so all leave the loop at the same step."""
    stop = False
    if jax.process_index() == 0:
        for action in actions:
            stop = action.run(state, metrics) or stop
    if actions and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stop = bool(multihost_utils.broadcast_one_to_all(np.int32(stop)))
    return stop
