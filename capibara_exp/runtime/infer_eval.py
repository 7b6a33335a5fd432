"""T5X's inference evaluation in the local engine: `infer_eval_dataset_cfg` and
`inference_evaluator_cls` (seqio.Evaluator unless bound otherwise) as T5X's
eval.InferenceEvaluator uses them. The evaluator is made with log_dir
MODEL_DIR/inference_eval (its loggers, e.g. seqio.TensorBoardLogger, write there under
T5X's names) and the model's feature converter unpacked; each evaluation predicts with
T5X's DecoderOnlyModel.predict_batch_with_aux (the model's decode_fn; greedy by default),
`num_samples` decodes per example when the decode_fn asks for several (generation/
infer_sampling.py: each example's prediction is then the list of its samples, as seqio
takes top-k decodes), and the task's metric_fns score the predictions. The metrics also go
to metrics.jsonl (split 'inference_eval', keys '<task>/<metric>') and to the INFER_EVAL
actions."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capibara_exp.runtime.utils import DatasetConfig

SPLIT = "inference_eval"


def _plain(value: Any) -> Any:
    """seqio's metric values (Scalar, numpy) as numbers."""
    value = getattr(value, "value", value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class InferEval:
    def __init__(self, cfg: DatasetConfig, evaluator_cls: Any, model: Any, model_dir: str):
        from t5x import models

        from capibara_exp.runtime import decoding, inputs

        inputs.import_modules(cfg)
        self.cfg = cfg
        decode_fn = getattr(model, "decode_fn", None) or decoding.decode_fn(decoding.Sampling())
        self.t5x_model = models.DecoderOnlyModel(
            model.module, model.vocabulary, optimizer_def=None, decode_fn=decode_fn,
            inputs_bidirectional_attention=model.inputs_bidirectional_attention)
        self.evaluator = evaluator_cls(
            mixture_or_task_name=cfg.mixture_or_task_name,
            feature_converter=model.FEATURE_CONVERTER_CLS(pack=False),
            eval_split=cfg.split, use_cached=cfg.use_cached, seed=cfg.seed,
            sequence_length=dict(cfg.task_feature_lengths),
            use_memory_cache=cfg.use_memory_cache, log_dir=os.path.join(model_dir, SPLIT))
        self.num_samples = int(getattr(decode_fn, "num_samples", 1))
        self._predict = jax.jit(lambda params, batch: self.t5x_model.predict_batch_with_aux(
            params, batch, rng=jax.random.PRNGKey(0), num_decodes=self.num_samples,
            return_all_decodes=self.num_samples > 1)[0])

    def predict_fn(self, dataset: Any, params: Any) -> list[tuple[int, list]]:
        """seqio's predict_fn: (index, tokens) of every (index, features) example (tokens:
        [num_samples][length] when several), in batches of the config's batch_size (the
        last padded: one compiled program)."""
        size, out = self.cfg.batch_size, []
        rows = list(dataset.as_numpy_iterator())
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            real = len(chunk)
            chunk += [chunk[0]] * (size - real)
            batch = {k: jnp.asarray(np.stack([f[k] for _, f in chunk]))
                     for k in chunk[0][1]}
            tokens = np.asarray(jax.device_get(self._predict(params, batch)))
            out += [(int(chunk[i][0]), tokens[i].tolist()) for i in range(real)]
        return out

    def evaluate(self, params: Any, step: int) -> dict[str, dict[str, float]]:
        """T5X's metrics_by_task of one inference evaluation."""
        metrics, _ = self.evaluator.evaluate(
            compute_metrics=jax.process_index() == 0, step=step,
            predict_fn=lambda ds: self.predict_fn(ds, params))
        metrics = metrics.result() if hasattr(metrics, "result") else metrics
        return {task: {k: _plain(v) for k, v in m.items()} for task, m in (metrics or {}).items()}

    def close(self) -> None:
        self.evaluator.close()


def make(args: dict[str, Any], model_dir: str) -> InferEval | None:
    """The run's inference evaluator, when train's infer_eval_dataset_cfg is set."""
    cfg = args.get("infer_eval_dataset_cfg")
    if cfg is None:
        return None
    import seqio

    return InferEval(cfg, args.get("inference_evaluator_cls") or seqio.Evaluator,
                     args["model"], model_dir)


def evaluate_and_act(run: Any, state: Any, step: int) -> bool:
    """One inference evaluation: written (metrics.jsonl, the evaluator's loggers), shown,
    and given to the INFER_EVAL actions; True when one asks to stop."""
    from capibara_exp.runtime.actions import run_actions

    by_task = run.infer.evaluate(state.params, step)
    flat = {f"{task}/{k}": v for task, m in by_task.items() for k, v in m.items()
            if v is not None}
    run.writer.write(step, SPLIT, flat)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in flat.items())
    run.progress.message(f"step {step}: inference eval {shown or '(no metrics)'}")
    return run_actions(run.actions.get("INFER_EVAL", []), state, by_task)
