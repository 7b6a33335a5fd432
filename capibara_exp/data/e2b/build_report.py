"""What a build tells its user: counts per input file, the checks that stop it, warnings.

An input file from which no record was accepted is an error naming its top quarantine
reasons (not a silent exit 0). A domain or source whose examples do not fill every split
is left out of its mixture, with a warning, unless `require_all_domains=true`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from pathlib import Path

from capibara_exp.base.errors import ConfigError
from capibara_exp.data import routing
from capibara_exp.data.e2b.processing import Filters, NoExamplesError
from capibara_exp.data.e2b.quarantine import Quarantine


class BuildError(ConfigError):
    """The data cannot be built as configured (the message names the setting or file)."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _name(path: str, root: Path) -> str:
    p = Path(path)
    return str(p.relative_to(root)) if p.is_relative_to(root) else path


def per_input(ignored: dict[str, Counter], per_file: dict, quarantine: Quarantine, root: Path):
    """{file: accepted / quarantined / deduplicated / filtered / examples, reasons, keys}."""
    reasons = quarantine.per_source()
    out = {}
    for path, keys in ignored.items():
        q, counts = reasons.get(path, Counter()), per_file.get(path, {})
        out[_name(path, root)] = {
            "accepted": counts.get("accepted", 0),
            "quarantined": sum(q.values()),
            "deduplicated": counts.get("deduplicated", 0),
            "filtered": counts.get("filtered", 0),
            "examples": counts.get("examples", 0),
            "quarantine_reasons": dict(q.most_common()),
            "ignored_keys": dict(keys.most_common()),
        }
    return out


def _top(reasons: dict[str, int], n: int = 3) -> str:
    return ", ".join(f"{r} {c}" for r, c in list(reasons.items())[:n]) or "none"


def check_inputs(per_file: dict, cfg: dict, quarantine_path: Path) -> None:
    """BuildError for every input log from which nothing was accepted."""
    problems = []
    for i, path in enumerate(cfg["inputs"]["logs"]):
        counts = per_file.get(str(path))
        if counts is not None and counts["accepted"] == 0:
            problems.append(
                f"inputs.logs[{i}]: {path}: no record accepted, {counts['quarantined']} "
                f"line(s) quarantined (top reasons: {_top(counts['quarantine_reasons'])})"
            )
    if problems:
        raise BuildError("; ".join(problems) + f"; see {quarantine_path}")


def check_examples(examples, stats: dict, quarantine: Quarantine, cfg: dict, qpath: Path) -> None:
    """NoExamplesError naming every filter and what it dropped, and the quarantine counts."""
    if examples:
        return
    dropped = Counter(stats["dropped_by_filter"])
    detail = ", ".join(f"{k} dropped {v}" for k, v in dropped.most_common()) or "no input records"
    filters = dataclasses.asdict(Filters.from_dict(cfg["filters"]))
    raise NoExamplesError(
        f"0 of {stats['records_in']} execution records passed the filters ({detail}); "
        f"filters: {filters}; quarantined input lines: {quarantine.summary() or 'none'} "
        f"(see {qpath})"
    )


def left_out_tasks(rows: list[dict], sources: tuple[str, ...]) -> dict[str, str]:
    """Domains and sources with an empty split (their task would never yield: a mixture
    that sampled it would wait forever), and why."""
    out = {}
    for key, field in [(d, "domain") for d in routing.DOMAINS] + [(s, "source") for s in sources]:
        splits = Counter(r["split"] for r in rows if r[field] == key)
        empty = [s for s in routing.SPLITS if not splits[s]]
        if empty:
            n = sum(splits.values())
            out[key] = f"{n} example(s), none in split(s) {', '.join(empty)}"
    return out


def check_domains(left_out: dict[str, str], cfg: dict) -> None:
    domains = {k: v for k, v in left_out.items() if k in routing.DOMAINS}
    if domains and cfg["require_all_domains"]:
        raise BuildError(
            f"require_all_domains=true, but domain(s) {sorted(domains)} cannot fill every "
            f"split ({'; '.join(f'{k}: {v}' for k, v in sorted(domains.items()))}); "
            f"add logs, or set require_all_domains=false to leave them out of the mixture"
        )


def warnings(left_out: dict[str, str]) -> list[str]:
    return [f"'{key}' left out of its mixture: {why}" for key, why in sorted(left_out.items())]


def routing_stats(rows: list[dict]) -> dict:
    return {
        "examples": len(rows),
        "per_domain_split": {
            f"{d}/{s}": n
            for (d, s), n in sorted(Counter((r["domain"], r["split"]) for r in rows).items())
        },
        "per_difficulty": dict(Counter(r["difficulty"] for r in rows)),
        "per_source": dict(Counter(r["source"] for r in rows)),
    }
