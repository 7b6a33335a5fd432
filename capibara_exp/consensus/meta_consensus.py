"""Meta-consensus in one command: train K strategies, gate them on a held-out metric, merge
the ones that pass with the strategies' weights (or any merge method), evaluate the merge
like a member and write one report (`capibara-exp-meta`, conf/meta.yaml).

A strategy is an experiment or a list of overrides of the base command line, with a
weight. Members train one after the other in this process, each in its own run dir
(<out>/members/<name>), so an interrupted command resumes: a member whose final
checkpoint and final evaluation exist is not trained again, one cut short resumes from
its newest checkpoint. The gate reads a metric by name from each member's last record of
a split in its metrics.jsonl (`gate.metric: train_eval/loss`; any metric a run writes,
e.g. pass@k once inference evaluation writes it). The merge is consensus.merge (its own
integrity and shared-ancestor checks); the merged checkpoint is then evaluated by a run
of the first passing member's config that only evaluates, so its metric compares with
the members' on the same batches.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from capibara_exp.base.errors import ConfigError
from capibara_exp.composing import cross_rules

REPORT = "meta_report.json"
# (overrides) -> (the composed, checked config of one run, its config-group choices)
Composer = Callable[[list[str]], tuple[DictConfig, dict]]


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    overrides: tuple[str, ...]
    weight: float


def strategies(cfg: DictConfig) -> list[Strategy]:
    """The strategies of meta_consensus.strategies, checked (one line per mistake)."""
    found, names = [], set()
    for i, item in enumerate(OmegaConf.to_container(cfg.strategies) or []):
        where = f"meta_consensus.strategies[{i}]"
        if not isinstance(item, Mapping) or set(item) - {"name", "overrides", "experiment",
                                                         "weight"} or "name" not in item:
            raise ConfigError(f"{where}: a strategy is {{name, overrides and/or experiment, "
                              f"weight}}, got {item!r}")
        name, weight = str(item["name"]), item.get("weight", 1.0)
        if name in names or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{where}.name: {name!r} must be unique and a plain name "
                              "(letters, digits, _ and -): it names the member's run dir")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or \
                not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{where}.weight must be a finite number >= 0, got {weight!r}")
        overrides = [f"experiment={item['experiment']}"] if item.get("experiment") else []
        overrides += [str(o) for o in item.get("overrides") or []]
        names.add(name)
        found.append(Strategy(name, tuple(overrides), float(weight)))
    if len(found) < 2:
        raise ConfigError(f"meta_consensus.strategies: name at least two strategies, got "
                          f"{len(found)}")
    return found


def check(mc: DictConfig, members: list[Strategy]) -> None:
    """The gate's and the merge's settings, before anything trains (one line each)."""
    from capibara_exp.composing.merge_methods import spec_from

    g = mc.gate
    split, _, name = str(g.metric).partition("/")
    if not split or not name:
        raise ConfigError(f"meta_consensus.gate.metric must be <split>/<name> (e.g. "
                          f"train_eval/loss), got {g.metric!r}")
    if g.mode not in ("min", "max"):
        raise ConfigError(f"meta_consensus.gate.mode must be min or max, got {g.mode!r}")
    for key in ("max_ratio", "threshold"):
        value = g.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ConfigError(f"meta_consensus.gate.{key} must be a finite number or null, "
                              f"got {value!r}")
    if g.max_ratio is not None and g.max_ratio < 1:
        raise ConfigError(f"meta_consensus.gate.max_ratio must be >= 1 or null, got "
                          f"{g.max_ratio!r}")
    if not isinstance(g.min_pass_fraction, (int, float)) or not 0 <= g.min_pass_fraction <= 1:
        raise ConfigError(f"meta_consensus.gate.min_pass_fraction must be in [0, 1], got "
                          f"{g.min_pass_fraction!r}")
    try:
        params = dict(OmegaConf.to_container(mc.merge.params) or {})
        if mc.merge.method in WEIGHTED:
            params.setdefault("weights", [s.weight for s in members])
        spec_from(mc.merge.method, params).check_candidates(len(members), "strategies")
    except ValueError as err:
        raise ConfigError(f"meta_consensus.merge: {err}") from None


WEIGHTED = ("weighted", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della",
            "della_linear")  # the methods that take the strategies' weights


def _member_config(compose: Composer, cfg: DictConfig, strategy: Strategy, run_dir: Path
                   ) -> tuple[DictConfig, dict]:
    overrides = [*cfg.common, *strategy.overrides, f"model_dir={run_dir}", "consensus=none"]
    try:
        return compose(overrides)
    except ConfigError as err:
        raise ConfigError(f"meta_consensus.strategies ({strategy.name}): {err}") from None


def _finished(run_dir: Path, cfg: DictConfig, split: str) -> bool:
    """Whether a member trained to its last step and evaluated there."""
    from capibara_exp.runtime import checkpoints
    from capibara_exp.runtime.metrics import last_metrics

    total = int(cfg.trainer.train_steps)
    last = last_metrics(run_dir, split)
    return total in checkpoints.steps(run_dir) and last is not None and last["step"] == total


def metric_of(run_dir: Path, metric: str) -> float:
    """`split/name` of a run's last record of that split (metrics.jsonl)."""
    from capibara_exp.runtime.metrics import last_metrics

    split, _, name = metric.partition("/")
    last = last_metrics(run_dir, split)
    if last is None or name not in last:
        have = sorted(k for k in (last or {}) if k != "step")
        raise ConfigError(f"meta_consensus.gate.metric={metric!r}: {run_dir}/metrics.jsonl has "
                          f"no {name!r} in its {split!r} records (it has: {', '.join(have)})")
    return float(last[name])


def gate(values: dict[str, float], g: DictConfig) -> dict[str, str]:
    """{member: why it is rejected} by the metric: non-finite, beyond `threshold`, or worse
    than `max_ratio` x the best member's (min mode; max mode: below best / max_ratio)."""
    finite = {n: v for n, v in values.items() if math.isfinite(v)}
    best = (min if g.mode == "min" else max)(finite.values()) if finite else None
    rejected = {}
    for name, value in values.items():
        worse = (lambda a, b: a > b) if g.mode == "min" else (lambda a, b: a < b)
        if not math.isfinite(value):
            rejected[name] = f"{g.metric} is {value}"
        elif g.threshold is not None and worse(value, g.threshold):
            rejected[name] = f"{g.metric} {value:.4g} beyond gate.threshold {g.threshold}"
        elif g.max_ratio is not None and best is not None and worse(
                value, best * g.max_ratio if g.mode == "min" else best / g.max_ratio):
            rejected[name] = (f"{g.metric} {value:.4g} worse than gate.max_ratio="
                              f"{g.max_ratio} x the best member's {best:.4g}")
    return rejected


def run(cfg: DictConfig, compose: Composer, train: Callable[..., Any],
        say: Callable[[str], None]) -> dict:
    """Train (or resume) the members, gate, merge, evaluate the merge; returns the report,
    also written to <out>/meta_report.json. `train(cfg, run_dir, choices)` runs one member."""
    from capibara_exp.consensus.gate import ConsensusError

    mc, out = cfg.meta_consensus, Path(cfg.out).absolute()
    members = strategies(mc)
    check(mc, members)
    split = mc.gate.metric.partition("/")[0]
    configs = {s.name: _member_config(compose, mc, s, out / "members" / s.name) for s in members}
    for s in members:  # a pass@k gate needs members that report that k
        ks = OmegaConf.select(configs[s.name][0], "infer_eval.infer_eval_pass_ks")
        problem = cross_rules.unreported_pass_at_k(
            mc.gate.metric, OmegaConf.to_container(ks) if ks is not None else None)
        if problem:
            raise ConfigError(f"meta_consensus.gate.metric={mc.gate.metric}: strategy {s.name}: "
                              f"{problem}")
    for s in members:  # every member is composed and checked before any trains
        run_dir = out / "members" / s.name
        if _finished(run_dir, configs[s.name][0], split):
            say(f"member {s.name} finished: not retrained ({run_dir})")
            continue
        say(f"training member {s.name} ({' '.join(s.overrides) or 'the base command'})")
        train(configs[s.name][0], run_dir, configs[s.name][1])
    values = {s.name: metric_of(out / "members" / s.name, mc.gate.metric) for s in members}
    rejected = gate(values, mc.gate)
    passing = [s for s in members if s.name not in rejected]
    if len(passing) < max(1, math.ceil(mc.gate.min_pass_fraction * len(members))):
        lines = "; ".join(f"{n}: {why}" for n, why in rejected.items())
        raise ConsensusError(f"consensus not reached: {len(passing)} of {len(members)} members "
                             f"passed the gate, gate.min_pass_fraction="
                             f"{mc.gate.min_pass_fraction}; rejected: {lines}")
    merged_rep = _merge(mc, out, passing)
    merged_value = _evaluate_merged(compose, train, mc, configs[passing[0].name][0], out,
                                    passing[0])
    return _report(mc, out, members, values, rejected, merged_rep, merged_value)


def _merge(mc: DictConfig, out: Path, passing: list[Strategy]) -> dict:
    from capibara_exp.composing.merge_methods import spec_from
    from capibara_exp.consensus import run as run_parts
    from capibara_exp.consensus import store, validation
    from capibara_exp.consensus.gate import GateConfig
    from capibara_exp.consensus.merge import merge

    params = dict(OmegaConf.to_container(mc.merge.params) or {})
    if mc.merge.method in WEIGHTED:
        params.setdefault("weights", [s.weight for s in passing])
    spec = spec_from(mc.merge.method, params)
    candidates = [store.candidate_from_path(out / "members" / s.name, name=s.name)
                  for s in passing]
    first = out / "members" / passing[0].name
    evaluator, held_out = validation.from_parts(run_parts.load_parts(first / "config.gin"))
    merged_dir = out / "merged"
    if merged_dir.exists():  # the merge is redone from the members (its inputs)
        shutil.rmtree(merged_dir)
    base = store.candidate_from_path(mc.merge.base) if mc.merge.get("base") else None
    return merge(candidates, spec, merged_dir, evaluator,
                 GateConfig(max_val_loss_ratio=None), base,
                 report_evaluator=held_out)


def _evaluate_merged(compose: Composer, train: Callable[..., Any], mc: DictConfig,
                     member_cfg: DictConfig, out: Path, first: Strategy) -> float:
    """The gate's metric of the merged checkpoint: the first passing member's run, with
    the merged dir as its model dir, evaluating before (and instead of) training."""
    from capibara_exp.runtime import checkpoints

    merged_dir = out / "merged"
    step = checkpoints.steps(merged_dir)[-1]
    cfg, choices = _member_config(compose, mc, first, merged_dir)
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.trainer.train_steps = step
        cfg.curriculum = None  # its stages add up to the training steps: nothing trains here
        cfg.gin_bindings = [*(cfg.get("gin_bindings") or []),
                            "train_script.train.run_eval_before_training = True"]
    train(cfg, merged_dir, choices)
    return metric_of(merged_dir, mc.gate.metric)


def _report(mc: DictConfig, out: Path, members: list[Strategy], values: dict[str, float],
            rejected: dict[str, str], merged_rep: dict, merged_value: float) -> dict:
    rows = {r["name"]: r for r in merged_rep["candidates"]}
    better = min if mc.gate.mode == "min" else max
    passing = {n: v for n, v in values.items() if n not in rejected}
    best = better(passing, key=passing.get)
    rep = {"metric": mc.gate.metric, "mode": mc.gate.mode,
           "members": [{"name": s.name, "overrides": list(s.overrides), "weight": s.weight,
                        "run_dir": str(out / "members" / s.name), "metric": values[s.name],
                        "passed": s.name not in rejected,
                        "rejected_because": rejected.get(s.name),
                        "merge_weight": rows.get(s.name, {}).get("weight")} for s in members],
           "merge": {"method": merged_rep["method"], "checkpoint": merged_rep["merged_checkpoint"],
                     "held_out_loss": merged_rep["held_out_loss"],
                     "rejected": merged_rep["rejections"]},  # by the merge's own gate
           "merged": {"metric": merged_value, "best_member": best,
                      "best_member_metric": values[best],
                      "vs_best_member": merged_value - values[best]}}
    text = json.dumps(rep, indent=1)
    (out / REPORT).write_text(text)
    return json.loads(text)  # what the file says (lists, not tuples)


def summary_lines(rep: dict) -> list[str]:
    """The report as a table for the console."""
    lines = [f"{'member':16s} {'weight':>7s} {rep['metric']:>18s}  gate"]
    for m in rep["members"]:
        merged_why = rep["merge"]["rejected"].get(m["name"])
        weight = m["merge_weight"]
        verdict = (f"rejected: {m['rejected_because']}" if not m["passed"] else
                   f"passed; left out by the merge's gate: {merged_why}" if merged_why else
                   "passed; merged" if weight is None else f"passed; merge weight {weight:.3g}")
        lines.append(f"{m['name']:16s} {m['weight']:7.3g} {m['metric']:18.4f}  {verdict}")
    merged = rep["merged"]
    lines.append(f"{'merged':16s} {'':7s} {merged['metric']:18.4f}  "
                 f"({rep['merge']['method']['method']}; best member {merged['best_member']} "
                 f"{merged['best_member_metric']:.4f}, difference {merged['vs_best_member']:+.4f})")
    return lines
