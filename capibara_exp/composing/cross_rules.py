"""The rules that tie keys of a composed config together (a batch that divides by the
microbatches, experts by their partitions, pass@k by the samples drawn, ...): each takes the
flat {dotted key: value} of a config and returns the key(s) at fault and why, or None.
config_check.check runs them after every single key has passed its own rule. Pure: no
Hydra, no JAX.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capibara_exp.base import model_facts
from capibara_exp.composing import config_schema


def show(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).replace("'", "") if isinstance(value, list | dict) else str(value)


Found = tuple[str | tuple[str, ...], str] | None


def _periods(v: dict[str, Any]) -> Found:
    """T5X evaluates and checkpoints at the end of an 'epoch' of the shorter period."""
    eval_p, save_p = v.get("trainer.eval_period"), v.get("checkpoint.checkpoint_period")
    if not (isinstance(eval_p, int) and isinstance(save_p, int)):
        return None
    if max(eval_p, save_p) % min(eval_p, save_p):
        return (("trainer.eval_period", "checkpoint.checkpoint_period"),
                f"trainer.eval_period={eval_p} and checkpoint.checkpoint_period={save_p}: the "
                "longer must be a multiple of the shorter (T5X evaluates and checkpoints at "
                "the end of the shorter period)")
    return None


def _microbatches(v: dict[str, Any]) -> Found:
    mb, batch = v.get("trainer.num_microbatches"), v.get("data.batch_size")
    if isinstance(mb, int) and isinstance(batch, int) and batch % mb:
        return (("trainer.num_microbatches", "data.batch_size"),
                f"data.batch_size={batch} must divide by trainer.num_microbatches={mb}")
    return None


def _experts(v: dict[str, Any]) -> Found:
    experts, k = v.get("model.num_experts"), v.get("model.num_selected_experts")
    if isinstance(experts, int) and isinstance(k, int) and k > experts:
        return "model.num_selected_experts", f"must be <= model.num_experts={experts}"
    parts = v.get("partitioning.num_expert_partitions")
    if isinstance(experts, int) and isinstance(parts, int) and experts % parts:
        return ("partitioning.num_expert_partitions",
                f"must divide model.num_experts={experts} (experts split over the expert axis)")
    return None


def _model_parallel(v: dict[str, Any]) -> Found:
    """Heads, MLP and vocabulary are split over the `model` mesh axis."""
    parts = v.get("partitioning.num_partitions")
    if not isinstance(parts, int) or parts <= 1:
        return None
    for key in ("model.num_heads", "model.mlp_dim", "model.vocab_size"):
        size = v.get(key)
        if isinstance(size, int) and size % parts:
            return ("partitioning.num_partitions",
                    f"must divide {key}={size} (split over the model axis)")
    return None


def _rope(v: dict[str, Any]) -> Found:
    head_dim = v.get("model.head_dim")
    if v.get("model.position_embedding") == "rope" and isinstance(head_dim, int) and head_dim % 2:
        return "model.head_dim", "must be even with position_embedding=rope (rotated in pairs)"
    low, high = v.get("model.rope_low_freq_factor"), v.get("model.rope_high_freq_factor")
    if v.get("model.rope_scaling") == "llama3" and _numbers(low, high) and high <= low:
        return ("model.rope_high_freq_factor",
                f"must exceed model.rope_low_freq_factor={low} with rope_scaling=llama3")
    return None


def _remat(v: dict[str, Any]) -> Found:
    """Per-tensor remat lists belong to the policies that read them; one place a tensor."""
    policy = v.get("model.remat_policy")
    save, offload = v.get("model.remat_save") or [], v.get("model.remat_offload") or []
    for key, values in (("model.remat_save", save), ("model.remat_offload", offload)):
        if values and policy not in model_facts.REMAT_WITH_LISTS:
            return key, (f"lists tensors, which only model.remat_policy=offload or custom "
                         f"reads (got {policy})")
    both = sorted(set(save) & set(offload))
    if both:
        return "model.remat_offload", f"names {both}, also in model.remat_save"
    return None


def _numbers(*values: Any) -> bool:
    return all(isinstance(x, int | float) and not isinstance(x, bool) for x in values)


def _attention_heads(v: dict[str, Any]) -> Found:
    heads, kv = v.get("model.num_heads"), v.get("model.num_kv_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        return "model.num_kv_heads", (f"must divide model.num_heads={heads} (query heads share "
                                      "key/value heads in equal groups)")
    if v.get("model.sliding_window_pattern") is not None and v.get("model.sliding_window") is None:
        return ("model.sliding_window_pattern",
                "needs model.sliding_window (the window of the local layers)")
    return None


def _initial_checkpoint(v: dict[str, Any]) -> Found:
    path = v.get("checkpoint.initial_checkpoint")
    if isinstance(path, str) and not os.path.isdir(os.path.join(os.path.expanduser(path),
                                                                "state")):
        found = sorted(Path(path).expanduser().glob("checkpoint_*/state"))
        hint = f" (did you mean {found[-1].parent}?)" if found else ""
        return ("checkpoint.initial_checkpoint",
                f"{path} is not a checkpoint_<step> dir with state/{hint}")
    return None


def _vocabulary(v: dict[str, Any]) -> Found:
    kind, path, size = (v.get("model.vocabulary"), v.get("model.vocabulary_path"),
                        v.get("model.vocab_size"))
    if kind in model_facts.FILE_VOCABULARIES and not isinstance(path, str):
        return "model.vocabulary_path", f"must name the tokenizer file with vocabulary={kind}"
    if isinstance(path, str) and kind in model_facts.FILE_VOCABULARIES and \
            not os.path.isfile(os.path.expanduser(path)):
        return "model.vocabulary_path", f"{path} is not a file"
    if kind == "byte" and isinstance(size, int) and size < model_facts.BYTE_VOCAB_SIZE:
        return ("model.vocab_size", f"must be >= {model_facts.BYTE_VOCAB_SIZE} with "
                "vocabulary=byte (256 bytes and 3 special ids)")
    return None


def _schedule(v: dict[str, Any]) -> Found:
    factors = v.get("schedule.lr_factors")
    if not isinstance(factors, str):
        return None
    unknown = [f.strip() for f in factors.split("*")
               if f.strip() not in config_schema.SCHEDULE_FACTORS]
    if unknown:
        return "schedule.lr_factors", (f"unknown factor '{unknown[0]}': factors joined by * from "
                                       f"{', '.join(config_schema.SCHEDULE_FACTORS)}")
    return None


def _consensus(v: dict[str, Any]) -> Found:
    k, keep = v.get("consensus.merge_last_k"), v.get("checkpoint.checkpoints_to_keep")
    if isinstance(k, int) and isinstance(keep, int) and k > keep:
        return ("consensus.merge_last_k", "needs at least that many checkpoints kept "
                f"(checkpoint.checkpoints_to_keep={keep})")
    return None


def _curriculum(v: dict[str, Any]) -> Found:
    stages = v.get("curriculum.curriculum_stages")
    if not isinstance(stages, list):
        return None
    for i, stage in enumerate(stages):
        steps = stage.get("steps")
        if not isinstance(stage.get("mixture_or_task_name"), str) or not (
                isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            return ("curriculum.curriculum_stages",
                    f"stage {i} needs mixture_or_task_name (a string) and steps (>= 1)")
    total, steps = sum(s["steps"] for s in stages), v.get("trainer.train_steps")
    if isinstance(steps, int) and total != steps:
        return ("curriculum.curriculum_stages",
                f"stages add up to {total} steps, trainer.train_steps is {steps}")
    return None


def _lora_consensus(v: dict[str, Any]) -> Found:
    # A LoRA checkpoint holds the factors A and B: their mean is not the mean of the updates
    # A^T B, and its loss needs the frozen base. Merging is done on exports.
    if "lora.rank" in v and v.get("consensus.template"):
        return ("consensus.template", "a LoRA run's checkpoints hold adapter factors, which do "
                "not merge: export them (capibara-exp-lora export) and merge the exports "
                "with capibara-exp-merge (docs/lora.md)")
    return None


_PASS_AT = re.compile(r"(?:^|/)pass@(\d+)$")


def unreported_pass_at_k(metric: Any, pass_ks: Any) -> str | None:
    """Why `metric` (e.g. '<task>/pass@4') is not a pass@k the run's inference eval reports
    (its infer_eval_pass_ks); None when it is, or is no pass@k."""
    found = _PASS_AT.search(str(metric or ""))
    if not found:
        return None
    if not isinstance(pass_ks, list):
        return "pass@k comes from the inference eval: add infer_eval=codegen"
    if int(found.group(1)) not in pass_ks:
        return (f"pass@{found.group(1)} is not reported (infer_eval.infer_eval_pass_ks="
                f"{show(pass_ks)})")
    return None


def _infer_samples(v: dict[str, Any]) -> Found:
    """pass@k needs k samples; several samples need sampling; LoRA runs decode nothing."""
    n, ks = v.get("infer_eval.infer_eval_num_samples"), v.get("infer_eval.infer_eval_pass_ks")
    problem = unreported_pass_at_k(v.get("early_stopping.early_stopping_metric"), ks)
    if problem:
        return "early_stopping.early_stopping_metric", problem
    if not isinstance(n, int):
        return None
    if isinstance(ks, list) and not ks:
        return "infer_eval.infer_eval_pass_ks", "needs at least one k"
    big = [k for k in ks or () if isinstance(k, int) and k > n]
    if big:
        return (("infer_eval.infer_eval_pass_ks", "infer_eval.infer_eval_num_samples"),
                f"pass@{big[0]} needs at least {big[0]} samples per example "
                f"(infer_eval.infer_eval_num_samples={n})")
    if n > 1 and not v.get("infer_eval.infer_eval_temperature"):
        return ("infer_eval.infer_eval_num_samples", "more than one sample needs "
                "infer_eval.infer_eval_temperature > 0 (greedy decodes are all the same)")
    if "lora.rank" in v:  # the adapters alone are no model to decode with
        return ("infer_eval.infer_eval_num_samples", "a LoRA run has no inference eval "
                "(its checkpoints hold adapters only): export them (capibara-exp-lora export) "
                "and run capibara-exp-generate on the export")
    return None


def _infer_checker(v: dict[str, Any]) -> Found:
    """A checker is found by name now, not after training when the eval first scores (under
    engine=t5x a checker that fails to import there only reaches the run log)."""
    spec = v.get("infer_eval.infer_eval_checker")
    if not isinstance(spec, str):
        return None
    module, sep, name = spec.partition(":")
    if not (sep and module and name.isidentifier()):
        return "infer_eval.infer_eval_checker", "must be 'module:function'"
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return ("infer_eval.infer_eval_checker", f"no module {module!r} on this Python's path "
                "(set PYTHONPATH to the folder that holds it)")
    return None


def _merge_weights(v: dict[str, Any]) -> Found:
    if v.get("method") == "weighted" and v.get("weights") is None:
        return "weights", "method=weighted needs one weight per candidate"
    return None


CROSS_RULES: dict[str, tuple[Callable[[dict[str, Any]], Found], ...]] = {
    "config": (_periods, _microbatches, _experts, _model_parallel, _rope, _remat,
               _attention_heads,
               _vocabulary, _initial_checkpoint, _schedule,
               _consensus, _curriculum, _lora_consensus, _infer_samples,
               _infer_checker),
    "merge": (_merge_weights,),
}
