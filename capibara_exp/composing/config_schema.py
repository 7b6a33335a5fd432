"""What a value of the config may be: types, ranges and choices, checked at compose time.

A key's type comes from its YAML file (an int makes it an integer key, a list a list key).
RULES adds what YAML cannot say: a range, choices, or the type of a null default; a test
fails for a key with neither. Rules across keys live in cross_rules.py. Pure (the standard
library and OmegaConf values), so it runs before any heavy import.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from capibara_exp.base import model_facts


@dataclasses.dataclass(frozen=True)
class Rule:
    """A value's type and range. `null`: None is allowed too."""

    kind: str  # int | float | str | bool | list | map | any
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    item: Rule | None = None  # list items / map values
    null: bool = False
    valid: Callable[[Any], bool] | None = None  # a test beyond kind and range
    says: str = ""  # what `valid` allows, for the message
    # The problem with a value in words ("must be ..."), from the table that owns the rule
    # (composing/merge_methods.py's parameter checks); None when the value is allowed.
    explain: Callable[[Any], str | None] | None = None

    def problem(self, value: Any) -> str | None:
        """None if the value is allowed, else what is allowed."""
        if self.explain:
            found = self.explain(value)
            return found.removeprefix("must be ") if found else None
        if value is None:
            return None if self.null else self.allowed()
        if not _of_kind(self.kind, value):
            return self.allowed()
        if self.choices and value not in self.choices:
            return self.allowed()
        if self.valid and not self.valid(value):
            return self.allowed()
        bounds = ((self.ge, lambda v, b: v >= b), (self.gt, lambda v, b: v > b),
                  (self.le, lambda v, b: v <= b), (self.lt, lambda v, b: v < b))
        if self.kind in ("int", "float") and not all(
                b is None or ok(value, b) for b, ok in bounds):
            return self.allowed()
        if self.item and self.kind == "list" and any(self.item.problem(v) for v in value):
            return self.allowed()
        if self.item and self.kind == "map" and any(self.item.problem(v) for v in value.values()):
            return self.allowed()
        return None

    def allowed(self) -> str:
        if self.says:
            text = self.says
        elif self.choices:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        else:
            text = {"int": "an integer", "float": "a number", "str": "a string",
                    "bool": "true or false", "list": "a list", "map": "a mapping",
                    "any": "any value"}[self.kind]
            limits = [f"{op} {_num(b)}" for op, b in
                      ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                      if b is not None]
            text += (" " + " and ".join(limits)) if limits else ""
            if self.item and self.item.kind != "any":
                text += f" of {self.item.allowed()}" if self.kind == "list" else \
                    f" to {self.item.allowed()}"
        return text + (" (or null)" if self.null else "")


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _of_kind(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool) and \
            math.isfinite(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "list":
        return isinstance(value, list | tuple)
    if kind == "map":
        return isinstance(value, Mapping)
    return True


def Int(ge: float | None = None, *, gt: float | None = None, le: float | None = None,  # noqa: N802
        null: bool = False) -> Rule:
    return Rule("int", ge=ge, gt=gt, le=le, null=null)


def Float(ge: float | None = None, *, gt: float | None = None, le: float | None = None,  # noqa: N802
          lt: float | None = None, null: bool = False) -> Rule:
    return Rule("float", ge=ge, gt=gt, le=le, lt=lt, null=null)


def Choice(*choices: Any, null: bool = False) -> Rule:  # noqa: N802
    kinds = {type(c).__name__ for c in choices}
    return Rule(kinds.pop() if len(kinds) == 1 else "any", choices=choices, null=null)


def ListOf(item: Rule, null: bool = False) -> Rule:  # noqa: N802
    return Rule("list", item=item, null=null)


def MapOf(value: Rule, null: bool = False) -> Rule:  # noqa: N802
    return Rule("map", item=value, null=null)


def infer(value: Any) -> Rule | None:
    """The rule a YAML default implies; None when it implies none (null, ???, ${...})."""
    if value is None or (isinstance(value, str) and (value == "???" or "${" in value)):
        return None
    for kind in ("bool", "int", "float", "str", "list", "map"):
        if _of_kind(kind, value):
            return Rule(kind, item=Rule("any") if kind in ("list", "map") else None)
    return Rule("any")


POSITIVE = Int(1)


def _a_path(value: str) -> bool:
    return bool(value.strip()) and "\0" not in value


def _a_name(value: str) -> bool:
    parts = value.replace("\\", "/").split("/")
    return _a_path(value) and not value.startswith("/") and not {".", ".."} & set(parts)


def PathRule(null: bool = False) -> Rule:  # noqa: N802
    """A file or directory: an empty one would mean the current directory."""
    return Rule("str", valid=_a_path, null=null,
                says="a path (not empty: an empty one would mean the current directory)")


def _is_topology(name: str) -> bool:
    if name == "cpu":  # the default: the slices' tables load only for a slice
        return True
    from capibara_exp.base import topologies

    try:
        return bool(topologies.get(name))
    except ValueError:
        return False

RATE = Float(0.0, lt=1.0)  # dropout-like rates
SCHEDULE_FACTORS = ("constant", "linear_warmup", "rsqrt_decay", "rsqrt_normalized_decay",
                    "decay_every", "cosine_decay", "linear_decay")

# capibara-exp (conf/config.yaml and its groups). Keys are dotted paths; a map value's own
# keys are free (task_feature_lengths: {targets: 128}).
RULES: dict[str, Rule] = {
    "name": Rule("str", valid=_a_name, says="a name under outputs/ (not empty, not absolute, "
                                            "no '.' or '..' parts)"),
    "model_dir": PathRule(null=True), "data_dir": PathRule(),
    "random_seed": Int(0, null=True),
    "topology": Rule("str", valid=_is_topology,
                     says="cpu, a TPU slice (v4-8 ... v4-512, v5e-1 ... v5e-256, v5p-8 ... "
                          "v5p-512, v6e-1 ... v6e-256) or N slices over DCN ('2xv5e-256')"),
    "verbose": Rule("bool"),
    **dict.fromkeys(("gin_bindings", "gin_files", "gin_search_paths"), ListOf(Rule("str"))),
    "compilation_cache_dir": PathRule(null=True),
    "sweep_trial": MapOf(Rule("any"), null=True),
    "distributed.mode": Choice("single", "auto", "explicit"),
    "distributed.coordinator_address": Rule("str", null=True),
    "distributed.num_processes": Int(1, null=True),
    "distributed.process_id": Int(0, null=True),
    "distributed.local_device_ids": ListOf(Int(0), null=True),
    "distributed.initialization_timeout_s": POSITIVE, "distributed.heartbeat_timeout_s": POSITIVE,
    "distributed.shutdown_timeout_s": POSITIVE, "distributed.peer_check_s": POSITIVE,
    # model
    "model.vocab_size": POSITIVE, "model.emb_dim": POSITIVE, "model.num_heads": POSITIVE,
    "model.head_dim": POSITIVE, "model.num_layers": POSITIVE, "model.mlp_dim": POSITIVE,
    "model.mlp_activations": ListOf(Choice(*model_facts.ACTIVATIONS)), "model.dropout_rate": RATE,
    "model.position_embedding": Choice(*model_facts.POSITION_EMBEDDINGS),
    "model.dtype": Choice(*model_facts.DTYPES), "model.attention": Choice(*model_facts.ATTENTIONS),
    "model.remat_policy": Choice(*model_facts.REMAT_POLICIES),
    **dict.fromkeys(("model.remat_save", "model.remat_offload"),
                    ListOf(Choice(*model_facts.REMAT_NAMES))),
    "model.vocabulary": Choice(*model_facts.VOCABULARIES),
    "model.vocabulary_path": Rule("str", null=True), "model.num_kv_heads": Int(1, null=True),
    "model.rope_max_wavelength": Float(gt=0.0),
    "model.rope_scaling": Choice(*model_facts.ROPE_SCALINGS),
    "model.rope_scaling_factor": Float(gt=0.0), "model.rope_low_freq_factor": Float(gt=0.0),
    "model.rope_high_freq_factor": Float(gt=0.0), "model.rope_original_max_positions": POSITIVE,
    "model.local_rope_max_wavelength": Float(gt=0.0, null=True),
    "model.query_pre_attn_scalar": Float(gt=0.0, null=True),
    **dict.fromkeys(("model.attn_logit_softcap", "model.final_logit_softcap"),
                    Float(gt=0.0, null=True)), "model.norm_epsilon": Float(gt=0.0),
    "model.sliding_window": Int(1, null=True), "model.sliding_window_pattern": Int(1, null=True),
    "model.norm_placement": Choice(*model_facts.NORM_PLACEMENTS),
    "model.z_loss": Float(0.0), "model.label_smoothing": RATE,
    "model.num_experts": POSITIVE, "model.num_selected_experts": POSITIVE,
    "model.capacity_factor": Float(gt=0.0), "model.eval_capacity_factor": Float(gt=0.0),
    "model.min_expert_capacity": Int(0), "model.moe_layer_interval": POSITIVE,
    "model.router_jitter_noise": RATE, "model.expert_dropout_rate": RATE,
    "model.aux_loss_factor": Float(0.0), "model.router_z_loss_factor": Float(0.0),
    "model.loss_normalizing_factor": Float(gt=0.0, null=True),
    # data
    "data.task_feature_lengths": MapOf(POSITIVE),
    "data.mixture_rates": MapOf(Float(gt=0.0)),
    "data.batch_size": POSITIVE,
    "data.mixture_or_task_module": Rule("str", null=True),
    "data.packing": Choice("first_fit", "next_fit", "seqio"),
    # optimizer
    "optimizer.grad_clip_norm": Float(gt=0.0), "optimizer.adam_b1": Float(0.0, lt=1.0),
    "optimizer.adam_b2": Float(0.0, lt=1.0), "optimizer.adam_eps": Float(gt=0.0),
    "optimizer.weight_decay": Float(0.0),
    # schedule
    "schedule.base_learning_rate": Float(gt=0.0, le=1.0), "schedule.warmup_steps": Int(0),
    "schedule.decay_factor": Float(gt=0.0, le=1.0), "schedule.steps_per_cycle": POSITIVE,
    # trainer
    "trainer.train_steps": POSITIVE, "trainer.eval_steps": Int(0), "trainer.eval_period": POSITIVE,
    "trainer.stats_period": POSITIVE, "trainer.num_microbatches": Int(1, null=True),
    # partitioning
    "partitioning.num_partitions": POSITIVE, "partitioning.num_expert_partitions": POSITIVE,
    "partitioning.model_parallel_submesh": ListOf(POSITIVE, null=True),
    "partitioning.parameter_partitioning_dims": Choice(1, 2),
    "partitioning.activation_sharding": Choice("batch", "tensor", "sequence"),
    # checkpoint
    "checkpoint.checkpoint_period": POSITIVE, "checkpoint.checkpoints_to_keep": Int(1, null=True),
    "checkpoint.checkpoint_dtype": Choice(*model_facts.DTYPES),
    "checkpoint.initial_checkpoint": PathRule(null=True),
    # engine
    "engine.name": Choice("local", "t5x", "tpu_vm"), "engine.runtime": Choice("t5x", "local"),
    "engine.python": Rule("str", null=True), "engine.extra_flags": ListOf(Rule("str")),
    "engine.tpu_name": Rule("str"), "engine.zone": Rule("str"), "engine.workdir": Rule("str"),
    "engine.project": Rule("str", null=True), "engine.model_dir": Rule("str"),
    # optional groups
    "early_stopping.early_stopping_mode": Choice("min", "max"),
    "early_stopping.early_stopping_patience": POSITIVE,
    "early_stopping.early_stopping_atol": Float(0.0),
    "early_stopping.early_stopping_rtol": Float(0.0),
    "ema.ema_decay": Float(gt=0.0, lt=1.0),
    **{f"infer_eval.infer_eval_{key}": rule for key, rule in dict(  # infer_eval.infer_eval_*
        task=Rule("str"), module=Rule("str"), split=Rule("str"), inputs_length=POSITIVE,
        targets_length=POSITIVE, batch_size=POSITIVE, num_samples=POSITIVE,
        temperature=Float(0.0), top_p=Float(0.0, le=1.0), pass_ks=ListOf(POSITIVE),
        score_mode=Choice("stdout", "no_error"), checker=Rule("str", null=True)).items()},
    "nan_guard.max_consecutive_skips": POSITIVE,
    "curriculum.curriculum_stages": ListOf(MapOf(Rule("any"))),
    "router_supervision.router_supervision_factor": Float(0.0),
    "lora.base_checkpoint": PathRule(), "lora.rank": POSITIVE, "lora.alpha": Float(gt=0.0),
    "lora.dropout": RATE, "lora.quantize_base": Choice("none", "nf4", "int4", "int8"),
    "lora.quantize_block_size": Int(1, null=True),
    "lora.target_axes": ListOf(ListOf(Rule("str"))), "lora.target_modules": ListOf(Rule("str")),
    "monitor.memory_warn_fraction": Float(gt=0.0, le=1.0),
    "wandb.wandb_name": Rule("str", null=True),
    "wandb.wandb_mode": Choice("offline", "online", "disabled"),
    "mlflow.mlflow_tracking_uri": Rule("str", null=True),
    "mlflow.mlflow_run_name": Rule("str", null=True),
    "engine.max_restarts": Int(0), "engine.restart_backoff_s": Int(0),
    "engine.restart_backoff_max_s": Int(0),
    "consensus.template": Rule("str", null=True),
    "consensus.merge_last_k": POSITIVE, "consensus.merge_params": MapOf(Rule("any"), null=True),
    "consensus.merge_min_pass_fraction": Float(0.0, le=1.0),
    "consensus.merge_max_val_loss_ratio": Float(gt=0.0, null=True),
    "consensus.merge_report_steps": Int(0, null=True),
    "tune_mesh.search": Choice("tpe", "random", "exhaustive"),
    "tune_mesh.n_trials": POSITIVE, "tune_mesh.max_compiles": Int(1, null=True),
    "tune_mesh.hbm_reserve_gib": Float(0.0), "tune_mesh.budget_s": Float(gt=0.0, null=True),
    **dict.fromkeys(("tune_mesh.model_partitions", "tune_mesh.expert_partitions",
                     "tune_mesh.per_chip_batch"), ListOf(POSITIVE, null=True)),
    "tune_mesh.num_microbatches": ListOf(POSITIVE), "tune_mesh.fsdp": ListOf(Rule("bool")),
    "tune_mesh.remat_policies": ListOf(Choice(*model_facts.REMAT_POLICIES[:-1])),  # not custom
    "tune_mesh.splash_fused_bwd": ListOf(Rule("bool"), null=True),
    "tune_mesh.splash_blocks": ListOf(Int(128), null=True), "tune_mesh.confirm_top": Int(0),
    "tune_mesh.activation_shardings": ListOf(Choice("batch", "tensor", "sequence")),
    "tune_mesh.attentions": ListOf(Choice(*model_facts.ATTENTIONS), null=True),
    "tune_mesh.compile_workers": Int(1, null=True), "tune_mesh.seed": Int(0),
    "tune_mesh.measure_steps": POSITIVE, "tune_mesh.replay_seeds": POSITIVE,
    **dict.fromkeys(("tune_mesh.partitioning_name", "tune_mesh.conf_dir"), Rule("str", null=True)),
}

# capibara-exp-merge (conf/merge.yaml) and capibara-exp-data (conf/data_build.yaml).
MERGE_RULES: dict[str, Rule] = {
    # The merge methods' own parameters (weights, num_byzantine, ...) take their rules from
    # composing/merge_methods.py (merge_param_rule).
    "runs": Rule("any", valid=lambda v: all(isinstance(r, str) and _a_path(r) for r in (
        [v] if isinstance(v, str) else v if isinstance(v, list | tuple) else [None])),
        says="a run or checkpoint dir, or a list of them (no empty path)"),
    "out": PathRule(), "last_k": Int(1, null=True),
    "base": PathRule(null=True), "eval_config": PathRule(null=True),
    "eval_batches": Int(0, null=True), "report_batches": Int(0, null=True),
    "gate.max_val_loss": Float(null=True), "gate.max_val_loss_ratio": Float(gt=0.0, null=True),
    "gate.max_distance_ratio": Float(gt=0.0, null=True),
    "gate.min_pass_fraction": Float(0.0, le=1.0),
    "gate.max_relative_distance": Float(gt=0.0, null=True),
    "fedavg.num_clients": POSITIVE, "fedavg.rounds": POSITIVE, "fedavg.local_steps": POSITIVE,
    "fedavg.clip_norm": Float(gt=0.0, null=True), "fedavg.noise_multiplier": Float(0.0),
    "fedavg.target_delta": Float(gt=0.0, lt=1.0), "fedavg.seed": Int(0),
    "fedavg.fraction_fit": Float(gt=0.0, le=1.0), "fedavg.min_fit_clients": POSITIVE,
    "fedavg.initial_checkpoint": PathRule(null=True), "fedavg.proximal_mu": Float(0.0),
    "fedavg.aggregation": Choice("uniform", "median", "trimmed_mean", "krum", "multi_krum",
                                 "geometric_median"),
    "fedavg.num_byzantine": Int(0), "fedavg.num_selected": Int(1, null=True),
    "fedavg.server_optimizer": Choice("fedadam", "fedyogi", "fedavgm", null=True),
    "fedavg.eta": Float(0.0, null=True), "fedavg.beta_1": Float(0.0, null=True),
    "fedavg.beta_2": Float(0.0, null=True), "fedavg.tau": Float(0.0, null=True),
    "fedavg.server_learning_rate": Float(0.0, null=True),
    "fedavg.server_momentum": Float(0.0, null=True),
    "fedavg.target_epsilon": Float(gt=0.0, null=True), "fedavg.poisoned_clients": Int(0),
    "fedavg.poison": Choice("sign_flip", "scaled", "noise"),
}
DATA_BUILD_RULES: dict[str, Rule] = {
    "data_dir": PathRule(),
    "collect.max_per_source": Int(1, null=True), "collect.cell_timeout_s": Float(gt=0.0),
    "collect.memory_mb": POSITIVE, "max_line_bytes": POSITIVE,
    "filters.languages": ListOf(Rule("str"), null=True),
    "filters.min_quality": Float(0.0), "filters.min_code_chars": Int(0),
    "filters.max_code_chars": POSITIVE,
    "playbooks.min_success_rate": Float(0.0, le=1.0), "playbooks.top_k_per_domain": POSITIVE,
    "splits.validation_percent": Int(0, le=100), "splits.test_percent": Int(0, le=100),
    "secret_scrubbing.min_recall": Float(0.0, le=1.0),
}
# capibara-exp-meta (conf/meta.yaml, conf/meta_consensus/; consensus/meta_consensus.py
# checks the rest)
META_RULES: dict[str, Rule] = {
    "out": PathRule(), "meta_consensus.gate.threshold": Float(null=True),
    "meta_consensus.gate.max_ratio": Float(1.0, null=True),
    "meta_consensus.gate.min_pass_fraction": Float(0.0, le=1.0),
    "meta_consensus.gate.mode": Choice("min", "max"),
    "meta_consensus.merge.base": Rule("str", null=True),
}
RULES_BY_CONFIG = {"config": RULES, "merge": MERGE_RULES, "data_build": DATA_BUILD_RULES,
                   "meta": META_RULES}


def merge_method_rule() -> Rule:
    """consensus.merge_method / merge's `method`: the methods composing/merge_methods.py lists."""
    from capibara_exp.composing.merge_methods import METHODS

    return Choice(*METHODS)


def merge_param_rule(name: str) -> Rule | None:
    """A merge method's parameter (merge's `weights`, `num_byzantine`, ...): its check in
    composing/merge_methods.py; None for a key that is not one."""
    from capibara_exp.composing import merge_methods

    check = merge_methods.param_checks().get(name)
    return Rule("any", explain=check) if check else None


def merge_params_rule() -> Rule:
    """consensus.merge_params: a mapping of the registry's parameters to allowed values."""
    from capibara_exp.composing import merge_methods

    def explain(params: Any) -> str | None:
        checks = merge_methods.param_checks()
        if params is not None and not isinstance(params, Mapping):
            return f"must be a mapping of merge parameters or null, got {params!r}"
        for name, value in (params or {}).items():
            if name not in checks:
                return (f"must be a mapping of merge parameters ({', '.join(checks)}), "
                        f"got {name!r}")
            found = checks[name](value)
            if found:
                return f"must be a mapping whose {name} is {found.removeprefix('must be ')}"
        return None

    return Rule("map", explain=explain)


LAZY_RULES: dict[str, dict[str, Callable[[], Rule]]] = {
    "config": {"consensus.merge_method": merge_method_rule,
               "consensus.merge_params": merge_params_rule},
    "merge": {"method": lambda: Choice(*merge_method_rule().choices, "fedavg")},
}


def rule_for(config_name: str, key: str, default: Any) -> Rule | None:
    """The rule of `key`: RULES' entry, else what its YAML default implies."""
    lazy = LAZY_RULES.get(config_name, {}).get(key)
    if lazy:
        return lazy()
    if config_name == "merge" and "." not in key:
        rule = merge_param_rule(key)
        if rule:
            return rule
    table = RULES_BY_CONFIG.get(config_name, {})
    if key in table:
        return table[key]
    return infer(default)
