"""SeqIO tasks and mixtures of the MoE routing data, registered on import.

One task per expert domain (`capibara_routing_<domain>`) and one per source
(`capibara_e2b_logs`, `capibara_ace_playbooks`), each with train/validation/test splits
and the features `targets` (text), `domain`, `domain_id` and `difficulty`. `domain_id` is
the domain's index in routing.DOMAINS, a fixed order: python 0, sql 1, javascript 2,
debug 3, ml 4, api 5 (router supervision asks for expert `domain_id mod num_experts`).
Mixtures take their rates from conf/data/ (`mixture_rates` of every data config whose
task module is this one).
The tasks read the data built under $CAPIBARA_DATA_DIR (by `capibara-exp-data`, or by a run
before it starts: experiment.prepare_data) and never build them (data/e2b/built.py).
A domain or source whose built examples leave a split empty (the manifest's
`routing.left_out`, e.g. a build from user logs with no JavaScript) is left out of every
mixture: a mixture sampling an empty task would wait forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import seqio
import tensorflow as tf

from capibara_exp.data import routing
from capibara_exp.data.e2b import built
from capibara_exp.data.tasks import add_task, data_dir, variant_name

TASK_PREFIX = "capibara_routing_"
SOURCE_TASKS = {"e2b_logs": "capibara_e2b_logs", "ace_playbooks": "capibara_ace_playbooks"}


def domain_task(domain: str) -> str:
    return TASK_PREFIX + domain


def domain_id(domain: str) -> int:
    """The integer label of a domain: its index in routing.DOMAINS (never reordered)."""
    try:
        return routing.DOMAINS.index(domain)
    except ValueError:
        raise ValueError(f"routing data: unknown domain '{domain}' (domains: {routing.DOMAINS}); "
                         "rebuild the data with capibara-exp-data") from None


def _rows(kind: str, name: str, split: str) -> list[dict]:
    built.manifest(data_dir())  # NotBuilt: the command that builds them
    path = built.dataset_dir(data_dir()) / kind / name / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def examples(rows: list[dict]) -> tf.data.Dataset:
    """Built routing rows as a task's examples: `targets` (text) and the routing features."""
    return tf.data.Dataset.from_tensor_slices(
        {
            "targets": tf.constant([r["text"] for r in rows], tf.string),
            "domain": tf.constant([r["domain"] for r in rows], tf.string),
            "domain_id": tf.constant([domain_id(r["domain"]) for r in rows], tf.int32),
            "difficulty": tf.constant([r["difficulty"] for r in rows], tf.string),
        }
    )


def _dataset_fn(kind: str, name: str):
    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # one file per split; seqio shuffles the examples
        return examples(_rows(kind, name, split))

    return dataset_fn


def _add_task(name: str, kind: str, source_name: str,
              vocabulary: seqio.Vocabulary | None = None) -> None:
    add_task(name, _dataset_fn(kind, source_name), routing.SPLITS, vocabulary)


def _check_rates(name: str, rates: dict) -> dict[str, float]:
    unknown = set(rates) - set(routing.DOMAINS) - set(SOURCE_TASKS)
    if unknown:
        raise ValueError(
            f"mixture {name}: mixture_rates has unknown key(s) {sorted(unknown)} "
            f"(domains: {routing.DOMAINS}, sources: {tuple(SOURCE_TASKS)})"
        )
    bad = {k: v for k, v in rates.items() if not isinstance(v, (int, float)) or v < 0}
    if bad or not any(float(v) > 0 for v in rates.values()):
        raise ValueError(f"mixture {name}: mixture_rates must be >= 0 with one > 0, got {rates}")
    return {k: float(v) for k, v in rates.items()}


def _task_of(key: str, vocabulary: seqio.Vocabulary | None = None) -> str:
    """The task of a domain or source, in a vocabulary (registered on first use)."""
    name = variant_name(SOURCE_TASKS.get(key) or domain_task(key), vocabulary)
    kind = "sources" if key in SOURCE_TASKS else "routing"
    _add_task(name, kind, key, vocabulary)
    return name


def _left_out() -> dict[str, str]:
    """Domains and sources the built data leave out of mixtures (none before a build: a
    mixture named before the data exist, as in an ahead-of-time compile, is whole, and
    reading it says how to build them)."""
    try:
        return built.manifest(data_dir())["routing"].get("left_out", {})
    except (built.NotBuilt, KeyError):
        return {}


def _without_left_out(name: str, rates: dict[str, float], left_out: dict) -> dict[str, float]:
    kept = {k: r for k, r in rates.items() if k not in left_out}
    if not any(r > 0 for r in kept.values()):
        raise ValueError(
            f"mixture {name}: every task with a rate > 0 is left out of the built data "
            f"({left_out}); rebuild with more logs (capibara-exp-data)"
        )
    return kept


def add_mixture(name: str, rates: dict, left_out: dict | None = None,
                vocabulary: seqio.Vocabulary | None = None) -> str:
    """Register a mixture of routing tasks (keys: domains or sources) with these rates."""
    rates = _without_left_out(name, _check_rates(name, rates), left_out or {})
    if name not in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.add(
            name, [(_task_of(k, vocabulary), r) for k, r in rates.items() if r > 0])
    return name


def mixture_with_rates(name: str, rates: dict,
                       vocabulary: seqio.Vocabulary | None = None) -> str:
    """The mixture `name` (in the model's vocabulary) if it has these rates, else a
    registered variant that has them.

    gin calls this (gin/data/routing.gin), so rates overridden on the command line
    (data.mixture_rates.sql=2.0) and the model's vocabulary reach the mixture in both
    engines.
    """
    left_out = _left_out()
    rates = _without_left_out(name, _check_rates(name, dict(rates)), left_out)
    base = variant_name(name, vocabulary)
    if base in seqio.MixtureRegistry.names():
        mixture = seqio.get_mixture_or_task(base)
        current = {t.name: mixture.get_rate(t) for t in mixture.tasks}
        if current == {_task_of(k, vocabulary): r for k, r in rates.items() if r > 0}:
            return base
    if base != name and rates == _shipped_mixtures().get(name):
        return add_mixture(base, rates, left_out, vocabulary)
    tag = hashlib.sha256(json.dumps(rates, sort_keys=True).encode()).hexdigest()[:8]
    return add_mixture(f"{base}_{tag}", rates, left_out, vocabulary)


def _shipped_mixtures() -> dict[str, dict]:
    """name -> rates of every data config in conf/data/ whose task module is this one."""
    import yaml

    from capibara_exp.base.paths import CONF_DIR

    out = {}
    for path in sorted((CONF_DIR / "data").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text()) or {}
        if cfg.get("mixture_or_task_module") == __name__ and "mixture_rates" in cfg:
            out[cfg["mixture_or_task_name"]] = cfg["mixture_rates"]
    return out


def register() -> None:
    """Register every task and the shipped mixtures (idempotent)."""
    for domain in routing.DOMAINS:
        _add_task(domain_task(domain), "routing", domain)
    for source, task in SOURCE_TASKS.items():
        _add_task(task, "sources", source)
    left_out = _left_out()
    for name, rates in _shipped_mixtures().items():
        with contextlib.suppress(ValueError):  # all left out: mixture_with_rates says so
            add_mixture(name, rates, left_out)


register()
