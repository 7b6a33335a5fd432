"""Build the E2B / ACE / routing data under `<data_dir>/e2b_routing/` with a manifest.

gate (scrubbing measured on the held-out corpus) -> collect (sandbox, scrubbed) -> parse
(schema, quarantine) -> process (scrub, score, filter, dedup) -> playbooks -> routing
examples (domain, difficulty, split). The manifest records counts per input file, the
sha256 of every file the build wrote, the filters, the quarantine counts, the scrubbing
figures and the fingerprint of the build config: a run whose data are already built for
the same config reuses them, so the first run that needs the data builds them and the
others wait. A build holds `<data_dir>/e2b_routing/.capibara.lock` (capibara_exp.base.run_lock):
a second `capibara-exp-data` on the same data dir is refused with the holder's pid and host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
from collections import Counter
from pathlib import Path

from capibara_exp.base import atomic, run_lock
from capibara_exp.base.errors import ConfigError
from capibara_exp.data import routing
from capibara_exp.data.e2b import (
    at_rest,
    build_report,
    collector,
    heldout,
    playbooks,
    processing,
    sandbox,
    scrub,
)
from capibara_exp.data.e2b.build_report import BuildError
from capibara_exp.data.e2b.built import DATASET, dataset_dir
from capibara_exp.data.e2b.heldout import generated
from capibara_exp.data.e2b.quarantine import Quarantine
from capibara_exp.data.e2b.records import parse_records

SOURCES = ("e2b_logs", "ace_playbooks")
_KEYS = (
    "collect",
    "inputs",
    "max_line_bytes",
    "filters",
    "playbooks",
    "splits",
    "secret_scrubbing",
    "require_all_domains",
)
# The build's own folders: every file in them is hashed in the manifest, and a file a
# build did not write (left by an earlier build) is removed.
_OUTPUT_DIRS = ("logs", "examples", "playbooks", "quarantine", "routing", "sources")
__all__ = ["BuildError", "build", "build_config", "dataset_dir", "ensure_built", "summary"]


def default_config() -> dict:
    """The build settings shipped in conf/data_build.yaml (without data_dir and force)."""
    import yaml

    from capibara_exp.base.paths import CONF_DIR

    cfg = yaml.safe_load((CONF_DIR / "data_build.yaml").read_text())
    return {k: cfg[k] for k in _KEYS}


def fingerprint(cfg: dict) -> str:
    return hashlib.sha256(
        json.dumps({k: cfg[k] for k in _KEYS}, sort_keys=True).encode()
    ).hexdigest()[:16]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_lines(path, (json.dumps(r, ensure_ascii=False) for r in rows))


def scrubbing_report(sc: dict) -> dict:
    """The three measurements of the gate (bench/scrubbing.py prints them): the generated
    corpus (never-named formats in every context), leave-one-family-out, and the provider
    formats' held-out corpus with the negatives harvested from this machine."""
    gen = generated.evaluate(sc["seed"], sc["generated_positives"], sc["generated_negatives"])
    lofo = generated.leave_one_family_out(sc["seed"], sc["samples_per_family"])
    formats = heldout.evaluate(sc["seed"], sc["samples_per_format"])
    return {
        "generated": {k: v for k, v in gen.items() if k not in ("missed", "altered_examples")},
        "leave_one_family_out": {k: v for k, v in lofo.items() if k != "missed"},
        "provider_formats": {k: v for k, v in formats.items() if k != "missed_channels"},
    }


def _below(sc: dict, report: dict) -> list[str]:
    goal, most = sc["min_recall"], sc["max_negatives_altered"]
    gen, lofo, fmt = report["generated"], report["leave_one_family_out"], report["provider_formats"]
    problems = [f"never-named formats: recall {gen['recall']}"] if gen["recall"] < goal else []
    problems += [f"context {c}: recall {r}" for c, r in gen["recall_per_class"].items() if r < goal]
    if lofo["worst_recall"] < goal:
        problems.append(f"family {lofo['worst_family']} left out: recall {lofo['worst_recall']}")
    problems += [f"format {k}: recall {v}" for k, v in fmt["recall"].items() if v < goal]
    for name, share in (("generated", gen["negatives_altered_share"]),
                        ("harvested", fmt["negatives_altered_share"])):
        if share > most:
            problems.append(f"{name} negatives altered: {share:.2%} > {most:.0%}")
    return problems


def check_scrubbing(cfg: dict) -> dict:
    """The gate's figures, or BuildError: no training data are built with a scrubber below
    its goals (secret_scrubbing.min_recall per secret, max_negatives_altered)."""
    sc = cfg["secret_scrubbing"]
    report = scrubbing_report(sc)
    problems = _below(sc, report)
    if problems:
        raise BuildError(
            f"secret scrubbing below its goals (secret_scrubbing.min_recall={sc['min_recall']}, "
            f"max_negatives_altered={sc['max_negatives_altered']}): {'; '.join(problems)}: "
            "refusing to build training data"
        )
    return report


def _inputs(cfg: dict) -> list[Path]:
    for key in ("logs", "playbooks"):
        paths = cfg["inputs"][key]
        if not isinstance(paths, list):
            raise BuildError(f"inputs.{key} must be a list of JSONL files, got {paths!r}")
        for i, path in enumerate(paths):
            if not Path(path).is_file():
                raise BuildError(f"inputs.{key}[{i}]: {path} is not a file")
    return [Path(p) for p in cfg["inputs"]["logs"]]


def _quarantine_path(out: Path, name: str) -> Path:
    return out / "quarantine" / f"{name}.quarantine.jsonl"


def _records(out: Path, cfg: dict, quarantine: Quarantine, inputs: list[Path]):
    """Collect (if asked) and parse every log: the records, per-file keys, collection stats."""
    c = cfg["collect"]
    collected = out / "logs" / "collected.jsonl"
    stats: dict = {}
    if c["sources"]:
        limits = sandbox.Limits(cell_timeout_s=c["cell_timeout_s"], memory_mb=c["memory_mb"])
        _, stats = collector.collect(
            collected, c["sources"], c["max_per_source"], limits, c["use_e2b"]
        )
    paths = ([collected] if c["sources"] else []) + inputs
    records, ignored = [], {}
    for path in paths:  # the collected log goes through the same parser as any input
        ignored[str(path)] = Counter()
        records += parse_records(path, quarantine, cfg["max_line_bytes"], ignored[str(path)])
    return records, ignored, stats


def _examples(out: Path, cfg: dict, log_q: Quarantine, written: list[Path], inputs: list[Path]):
    """Parse and process the logs; the quarantine is written before anything can stop."""
    records, ignored, collection = _records(out, cfg, log_q, inputs)
    written += [out / "logs" / "collected.jsonl"] if cfg["collect"]["sources"] else []
    examples, stats = processing.process(
        records, processing.Filters.from_dict(cfg["filters"]), log_q
    )
    log_q.write(_quarantine_path(out, "logs"), root=out)
    written.append(_quarantine_path(out, "logs"))
    per_input = build_report.per_input(ignored, stats["per_file"], log_q, root=out)
    build_report.check_inputs(per_input, cfg, _quarantine_path(out, "logs"))
    build_report.check_examples(examples, stats, log_q, cfg, _quarantine_path(out, "logs"))
    _write_jsonl(out / "examples" / "examples.jsonl", examples)
    written.append(out / "examples" / "examples.jsonl")
    return examples, stats, collection, per_input


def _playbooks(out: Path, cfg: dict, examples: list[dict], pb_q: Quarantine, written: list[Path]):
    derived = out / "playbooks" / "derived.jsonl"
    playbooks.write(derived, playbooks.derive(examples))
    paths = [derived] + [Path(p) for p in cfg["inputs"]["playbooks"]]
    parsed = [pb for p in paths for pb in playbooks.parse(p, pb_q, cfg["max_line_bytes"])]
    pb_q.write(_quarantine_path(out, "playbooks"), root=out)
    kept, stats = playbooks.consolidate(parsed, playbooks.PlaybookFilters(**cfg["playbooks"]))
    playbooks.write(out / "playbooks" / "consolidated.jsonl", kept)
    written += [
        derived,
        _quarantine_path(out, "playbooks"),
        out / "playbooks" / "consolidated.jsonl",
    ]
    return kept, stats


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


def _write_tasks(out: Path, rows: list[dict]) -> list[Path]:
    written = []
    groups = [("routing", d, [r for r in rows if r["domain"] == d]) for d in routing.DOMAINS]
    groups += [("sources", s, [r for r in rows if r["source"] == s]) for s in SOURCES]
    for kind, name, items in groups:
        for split in routing.SPLITS:
            path = out / kind / name / f"{split}.jsonl"
            _write_jsonl(path, [r for r in items if r["split"] == split])
            written.append(path)
    return written


def _files(out: Path) -> list[Path]:
    return sorted(
        p
        for d in _OUTPUT_DIRS
        if (out / d).is_dir()
        for p in (out / d).rglob("*")
        if p.is_file() and not p.name.startswith(".")
    )


def build(data_dir: str | os.PathLike, cfg: dict) -> dict:
    """Build everything from scratch; return the manifest (also written as manifest.json).

    The quarantine files are written as soon as their input is parsed, so a build that
    stops for lack of examples still shows why; a build that stops leaves no manifest.
    """
    out = dataset_dir(data_dir)
    inputs = _inputs(cfg)
    scrubbing = check_scrubbing(cfg)
    (out / "manifest.json").unlink(missing_ok=True)  # the files are about to change
    log_q, pb_q, written = Quarantine(), Quarantine(), []
    examples, proc_stats, collection, per_input = _examples(out, cfg, log_q, written, inputs)
    kept, pb_stats = _playbooks(out, cfg, examples, pb_q, written)
    rows = _routing_rows(examples, kept, cfg["splits"])
    left_out = build_report.left_out_tasks(rows, SOURCES)
    build_report.check_domains(left_out, cfg)
    written += _write_tasks(out, rows)
    for stale in set(_files(out)) - set(written):
        stale.unlink()  # left by an earlier build with other settings; not part of this one
    found_at_rest = at_rest.final_pass(out, _files(out))
    manifest = {
        "dataset": DATASET,
        "fingerprint": fingerprint(cfg),
        "config": {k: cfg[k] for k in _KEYS},
        "inputs": per_input,
        "warnings": build_report.warnings(left_out),
        "secret_scrubbing": scrubbing,
        "sandbox_network": sandbox.network_isolation(),
        "collection": collection,
        "processing": {k: v for k, v in proc_stats.items() if k != "per_file"},
        "playbooks": pb_stats,
        "quarantine": {"logs": log_q.summary(), "playbooks": pb_q.summary()},
        "routing": {**build_report.routing_stats(rows), "left_out": left_out},
        "secrets_found_at_rest": found_at_rest,
        "files": {str(p.relative_to(out)): build_report.sha256(p) for p in _files(out)},
    }
    manifest = scrub.scrub_tree(manifest)[0]
    atomic.write_bytes(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


def ensure_built(data_dir: str | os.PathLike, cfg: dict | None = None, force: bool = False) -> dict:
    """The manifest of the built data, building them first if needed (one builder at a time).

    With no `cfg` (a training run reading its data) any existing build is used, so data
    built on purpose with other settings are never replaced; with a `cfg` (the
    `capibara-exp-data` command) a build made with other settings is rebuilt.
    """
    out = dataset_dir(data_dir)
    made = _first_missing(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _built_under_lock(out, data_dir, cfg, force)
    except (ConfigError, OSError):  # a refused build (BuildError, NoExamplesError, bad
        # settings) or one the disk failed (full, the file size limit)
        if made is not None:  # leaves nothing behind: the dirs it made go again
            shutil.rmtree(made, ignore_errors=True)
        raise


def _first_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist yet (None: it exists)."""
    path, missing = Path(os.path.abspath(path)), None
    while not path.exists() and path.parent != path:
        path, missing = path.parent, path
    return missing


# One builder per process too: the lock file is per process (a second thread would pass it).
_BUILDING = threading.Lock()


def _built_under_lock(out: Path, data_dir: str | os.PathLike, cfg: dict | None,
                      force: bool) -> dict:
    # A build asked for (cfg given: the command) is refused at once while another process
    # builds there; a run that only reads the data (cfg None) waits for that build.
    with _BUILDING, run_lock.held(out, "data_dir", shown=data_dir, wait=cfg is None) as note:
        if note:
            print(f"{DATASET}: {note}", file=sys.stderr, flush=True)
        manifest_path = out / "manifest.json"
        if manifest_path.exists() and not force:
            with contextlib.suppress(json.JSONDecodeError):
                manifest = json.loads(manifest_path.read_text())
                if cfg is None or manifest.get("fingerprint") == fingerprint(cfg):
                    return manifest
        return build(data_dir, cfg or default_config())


def summary(manifest: dict, data_dir: str | os.PathLike) -> dict:
    """What `capibara-exp-data` prints: where the manifest is and what the build did."""
    scrubbing = manifest["secret_scrubbing"]
    gen, lofo = scrubbing["generated"], scrubbing["leave_one_family_out"]
    scrubbed = Counter(manifest["collection"].get("secrets_scrubbed", {}))
    scrubbed.update(manifest["processing"]["secrets_scrubbed"])
    return {
        "manifest": str(dataset_dir(data_dir) / "manifest.json"),
        "inputs": manifest["inputs"],
        "warnings": manifest["warnings"],
        "examples": manifest["processing"]["examples_out"],
        "routing": manifest["routing"]["per_domain_split"],
        "quarantine": manifest["quarantine"],
        "secret_scrubbing": {
            "never_named_recall": gen["recall"],
            "lowest_context_recall": min(gen["recall_per_class"].values()),
            "worst_family_left_out": {lofo["worst_family"]: lofo["worst_recall"]},
            "provider_formats_min_recall": scrubbing["provider_formats"]["min_recall"],
            "negatives_altered_share": max(
                gen["negatives_altered_share"],
                scrubbing["provider_formats"]["negatives_altered_share"],
            ),
            "scrubbed_in_this_build": dict(sorted(scrubbed.items())),
            "found_at_rest": manifest.get("secrets_found_at_rest", {}),
        },
    }


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
