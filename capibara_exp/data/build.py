"""Build the E2B / ACE / routing data under `<data_dir>/e2b_routing/` with a manifest.

collect (sandbox) -> parse (quarantine) -> process (scrub, score, filter, dedup) ->
playbooks (derive, parse, consolidate) -> routing examples (domain, difficulty, split).
The manifest records counts, file hashes, the filters and the quarantine counts, and the
fingerprint of the build config: a run whose data are already built for the same config
reuses them, so the first run that needs the data builds them and the others wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

from capibara_exp.data import (
    collector,
    e2b_records,
    playbooks,
    processing,
    routing,
    sandbox,
    secrets,
)
from capibara_exp.data.corpus import _atomic_write
from capibara_exp.data.quarantine import Quarantine

DATASET = "e2b_routing"
SOURCES = ("e2b_logs", "ace_playbooks")
_KEYS = ("collect", "inputs", "max_line_bytes", "filters", "playbooks", "splits", "secret_recall")


class BuildError(ValueError):
    """The data cannot be built as configured (the message names the setting)."""


def dataset_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / DATASET


def default_config() -> dict:
    """The build settings shipped in conf/data_build.yaml (without data_dir and force)."""
    import yaml

    from capibara_exp.paths import CONF_DIR

    cfg = yaml.safe_load((CONF_DIR / "data_build.yaml").read_text())
    return {k: cfg[k] for k in _KEYS}


def fingerprint(cfg: dict) -> str:
    return hashlib.sha256(
        json.dumps({k: cfg[k] for k in _KEYS}, sort_keys=True).encode()
    ).hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())


def _check_recall(cfg: dict) -> float:
    rc = cfg["secret_recall"]
    value = secrets.recall(secrets.seeded_secrets(rc["seed"], rc["samples"]))
    if value < rc["min_recall"]:
        raise BuildError(
            f"secret scrubbing recall {value:.3f} on the seeded set is below "
            f"secret_recall.min_recall={rc['min_recall']}: refusing to build training data"
        )
    return value


def _records(out: Path, cfg: dict, quarantine: Quarantine) -> list[e2b_records.ExecutionRecord]:
    c = cfg["collect"]
    collected = out / "logs" / "collected.jsonl"
    limits = sandbox.Limits(cell_timeout_s=c["cell_timeout_s"], memory_mb=c["memory_mb"])
    if c["sources"]:
        collector.collect(collected, c["sources"], c["max_per_source"], limits, c["use_e2b"])
    paths = ([collected] if c["sources"] else []) + [Path(p) for p in cfg["inputs"]["logs"]]
    records = []
    for path in paths:  # the collected log goes through the same parser as any input
        records += e2b_records.parse_records(path, quarantine, cfg["max_line_bytes"])
    return records


def _routing_rows(examples: list[dict], kept: list[dict], splits: dict) -> list[dict]:
    v, t = splits["validation_percent"], splits["test_percent"]
    rows = [routing.routing_example(ex, "e2b_logs", v, t) for ex in examples]
    for pb in kept:
        rows.append(
            {
                "id": pb["agent_id"],
                "domain": pb["domain"],
                "difficulty": playbooks.difficulty(pb),
                "source": "ace_playbooks",
                "quality": pb["graduation_score"],
                "split": routing.split_of("playbook:" + pb["agent_id"], v, t),
                "text": playbooks.render(pb),
            }
        )
    return routing.ensure_every_split(rows)


def _write_tasks(out: Path, rows: list[dict]) -> dict[str, str]:
    files = {}
    groups = [("routing", d, [r for r in rows if r["domain"] == d]) for d in routing.DOMAINS]
    groups += [("sources", s, [r for r in rows if r["source"] == s]) for s in SOURCES]
    for kind, name, items in groups:
        for split in routing.SPLITS:
            path = out / kind / name / f"{split}.jsonl"
            _write_jsonl(path, [r for r in items if r["split"] == split])
            files[str(path.relative_to(out))] = _sha256(path)
    return files


def build(data_dir: str | os.PathLike, cfg: dict) -> dict:
    """Build everything from scratch; return the manifest (also written as manifest.json)."""
    out = dataset_dir(data_dir)
    recall = _check_recall(cfg)
    log_q, pb_q = Quarantine(), Quarantine()
    records = _records(out, cfg, log_q)
    filters = processing.Filters.from_dict(cfg["filters"])
    examples, proc_stats = processing.process(records, filters)
    _write_jsonl(out / "examples" / "examples.jsonl", examples)
    playbooks.write(out / "playbooks" / "derived.jsonl", playbooks.derive(examples))
    pb_paths = [out / "playbooks" / "derived.jsonl"] + [Path(p) for p in cfg["inputs"]["playbooks"]]
    parsed = [pb for p in pb_paths for pb in playbooks.parse(p, pb_q, cfg["max_line_bytes"])]
    kept, pb_stats = playbooks.consolidate(parsed, playbooks.PlaybookFilters(**cfg["playbooks"]))
    playbooks.write(out / "playbooks" / "consolidated.jsonl", kept)
    rows = _routing_rows(examples, kept, cfg["splits"])
    empty = [d for d in routing.DOMAINS if not any(r["domain"] == d for r in rows)]
    if empty:
        raise BuildError(
            f"no examples in domain(s) {empty} after filtering; filters: {cfg['filters']}, "
            f"playbooks: {cfg['playbooks']}, collect.sources: {cfg['collect']['sources']}"
        )
    log_q.write(out / "quarantine" / "logs.quarantine.jsonl")
    pb_q.write(out / "quarantine" / "playbooks.quarantine.jsonl")
    manifest = {
        "dataset": DATASET,
        "fingerprint": fingerprint(cfg),
        "config": {k: cfg[k] for k in _KEYS},
        "secret_scrubbing_recall": recall,
        "sandbox_network": sandbox.network_isolation(),
        "processing": proc_stats,
        "playbooks": pb_stats,
        "quarantine": {"logs": log_q.summary(), "playbooks": pb_q.summary()},
        "routing": {
            "examples": len(rows),
            "per_domain_split": {
                f"{d}/{s}": n
                for (d, s), n in sorted(Counter((r["domain"], r["split"]) for r in rows).items())
            },
            "per_difficulty": dict(Counter(r["difficulty"] for r in rows)),
            "per_source": dict(Counter(r["source"] for r in rows)),
        },
        "files": _write_tasks(out, rows),
    }
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


def ensure_built(data_dir: str | os.PathLike, cfg: dict | None = None, force: bool = False) -> dict:
    """The manifest of the built data, building them first if needed (one builder at a time).

    With no `cfg` (a training run reading its data) any existing build is used, so data
    built on purpose with other settings are never replaced; with a `cfg` (the
    `capibara-exp-data` command) a build made with other settings is rebuilt.
    """
    out = dataset_dir(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent runs of a sweep: one builds, the rest wait
        manifest_path = out / "manifest.json"
        if manifest_path.exists() and not force:
            with contextlib.suppress(json.JSONDecodeError):
                manifest = json.loads(manifest_path.read_text())
                if cfg is None or manifest.get("fingerprint") == fingerprint(cfg):
                    return manifest
        return build(data_dir, cfg or default_config())


def build_config(overrides: dict) -> dict:
    """The shipped build config with `overrides` (nested dicts) applied; unknown keys are errors."""
    cfg = default_config()
    for key, value in overrides.items():
        if key not in cfg:
            raise BuildError(f"data_build: unknown key '{key}' (known: {', '.join(_KEYS)})")
        if isinstance(value, dict):
            unknown = set(value) - set(cfg[key])
            if unknown:
                raise BuildError(f"data_build.{key}: unknown key(s) {sorted(unknown)}")
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg
