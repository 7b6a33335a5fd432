"""ACE agent playbooks: derived from the execution logs, parsed, filtered, consolidated.

A playbook (Agentic Context Engineering) is what an agent learned in a domain: bullets of
strategies that worked (`helpful` counts) and mistakes seen (`harmful` counts), with the
agent's interaction count, success rate, domain expertise and a graduation score. Here
an agent is one source of code (a stdlib module, a node package, a sqlite3 test file)
working in one domain, and its playbook is derived from its executed cells.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from capibara_exp.data import routing
from capibara_exp.data.e2b import scrub
from capibara_exp.data.e2b.jsonl import read_json_lines
from capibara_exp.data.e2b.quarantine import Quarantine
from capibara_exp.data.e2b.reasons import MISSING_FIELD, OUT_OF_RANGE, PROCESSING_ERROR, WRONG_TYPE

_FEATURE_ADVICE = {
    "functions": "Factor the work into small functions",
    "classes": "Group state and behaviour in a class",
    "loops": "Iterate explicitly over the data",
    "imports": "Import exactly the names used",
    "comprehensions": "Build collections with comprehensions / map-filter",
    "exceptions": "Handle the failure cases explicitly",
    "async": "Await asynchronous calls",
    "conditionals": "Branch on the edge cases",
    "sql_joins": "Join tables on their keys",
    "sql_aggregates": "Aggregate with COUNT/SUM/AVG",
    "sql_group_by": "GROUP BY the reporting key",
    "sql_subqueries": "Use a subquery for the inner set",
    "sql_ddl": "Create the schema before querying",
    "sql_writes": "Write rows with INSERT/UPDATE",
    "sql_order_by": "ORDER BY for a stable output",
    "sql_transactions": "Wrap writes in a transaction",
}
_FIELDS = {
    "agent_id": (str,),
    "domain": (str,),
    "graduation_score": (int, float),
    "interactions": (int,),
    "success_rate": (int, float),
    "domain_expertise": (dict,),
    "entries": (list,),
}


@dataclasses.dataclass(frozen=True)
class PlaybookFilters:
    """Which playbooks are kept (conf/data_build.yaml: playbooks)."""

    min_graduation_score: float = 0.0
    min_interactions: int = 1
    min_success_rate: float = 0.0
    top_k_per_domain: int = 8


def graduation_score(success_rate: float, interactions: int, mean_quality: float) -> float:
    """0..1: success, quality, and confidence that grows with the number of interactions."""
    confidence = 1.0 - math.exp(-interactions / 10.0)
    return round((0.5 * success_rate + 0.5 * mean_quality) * confidence, 4)


def _entries(items: list[dict]) -> list[dict]:
    feats, errors = Counter(), Counter()
    for ex in items:
        if ex["succeeded"]:
            feats.update(k for k, v in ex["features"].items() if v and k in _FEATURE_ADVICE)
        else:
            err = ex["error"] or {"name": "", "value": ""}
            errors[(err["name"], (err["value"].splitlines() or [""])[0][:120])] += 1
    entries = [
        {"section": "strategies", "content": _FEATURE_ADVICE[k], "helpful": n, "harmful": 0}
        for k, n in feats.most_common(6)
    ]
    entries += [
        {
            "section": "common_mistakes",
            "content": f"Avoid {name}: {value}",
            "helpful": 0,
            "harmful": n,
        }
        for (name, value), n in errors.most_common(4)
    ]
    best = max((ex for ex in items if ex["succeeded"]), key=lambda ex: ex["quality"], default=None)
    if best is not None and len(best["code"]) <= 600:
        entries.append(
            {
                "section": "code_snippets",
                "content": best["code"].rstrip(),
                "helpful": 1,
                "harmful": 0,
            }
        )
    return [{"id": f"e{i}", **e} for i, e in enumerate(entries)]


def derive(examples: list[dict]) -> list[dict]:
    """One playbook per (source, domain) agent, from that agent's executed cells."""
    by_agent: dict[tuple[str, str], list[dict]] = defaultdict(list)
    by_source: dict[str, Counter] = defaultdict(Counter)
    for ex in examples:
        domain = routing.domain_of(ex)
        by_agent[(ex["source"], domain)].append(ex)
        by_source[ex["source"]][domain] += 1
    out = []
    for (source, domain), items in sorted(by_agent.items()):
        success = sum(ex["succeeded"] for ex in items) / len(items)
        quality = sum(ex["quality"] for ex in items) / len(items)
        total = sum(by_source[source].values())
        out.append(
            {
                "agent_id": f"{domain}/{source}",
                "domain": domain,
                "graduation_score": graduation_score(success, len(items), quality),
                "interactions": len(items),
                "success_rate": round(success, 4),
                "domain_expertise": {d: round(n / total, 4) for d, n in by_source[source].items()},
                "entries": _entries(items),
            }
        )
    return out


def _number_in(obj: dict, key: str, low: float, high: float) -> str | None:
    value = obj[key]
    if not (math.isfinite(value) and low <= value <= high):
        return f"{OUT_OF_RANGE}: {key} must be in [{low}, {high}], got {value}"
    return None


def _check_entry(i: int, entry) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
        return f"{WRONG_TYPE}: entries[{i}] must be an object with a string 'content'"
    if not isinstance(entry.get("section", ""), str):
        return f"{WRONG_TYPE}: entries[{i}].section must be str"
    for count in ("helpful", "harmful"):
        value = entry.get(count, 0)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{WRONG_TYPE}: entries[{i}].{count} must be int, got {type(value).__name__}"
        if value < 0:
            return f"{OUT_OF_RANGE}: entries[{i}].{count} must be >= 0, got {value}"
    return None


def validate(obj: dict) -> str | None:
    """None for a valid playbook, else '<reason>: <detail>' naming the field."""
    for key, types in _FIELDS.items():
        if key not in obj:
            return f"{MISSING_FIELD}: {key} is missing"
        if not isinstance(obj[key], types) or isinstance(obj[key], bool):
            return f"{WRONG_TYPE}: {key} must be {'/'.join(t.__name__ for t in types)}"
    if obj["domain"] not in routing.DOMAINS:
        return f"{WRONG_TYPE}: domain must be one of {routing.DOMAINS}, got {obj['domain']!r}"
    if obj["interactions"] < 1:
        return f"{OUT_OF_RANGE}: interactions must be >= 1, got {obj['interactions']}"
    problem = _number_in(obj, "success_rate", 0.0, 1.0) or _number_in(
        obj, "graduation_score", 0.0, 1.0
    )
    if problem:
        return problem
    for domain, share in obj["domain_expertise"].items():
        if not isinstance(share, (int, float)) or isinstance(share, bool):
            return f"{WRONG_TYPE}: domain_expertise[{domain!r}] must be a number"
        if not (math.isfinite(share) and 0.0 <= share <= 1.0):
            return f"{OUT_OF_RANGE}: domain_expertise[{domain!r}] must be in [0, 1], got {share}"
    for i, entry in enumerate(obj["entries"]):
        problem = _check_entry(i, entry)
        if problem:
            return problem
    return None


def parse(path: Path, quarantine: Quarantine, max_line_bytes: int) -> list[dict]:
    """Playbooks of one JSONL file, scrubbed (their text becomes training data); malformed
    lines are quarantined with their reason."""
    out = []
    for line_no, obj in read_json_lines(path, quarantine, max_line_bytes):
        problem = validate(obj)
        if problem:
            reason, _, detail = problem.partition(": ")
            quarantine.add(str(path), line_no, reason, detail, json.dumps(obj, ensure_ascii=False))
            continue
        try:
            out.append(scrub.scrub_tree(obj)[0])
        except Exception as err:  # noqa: BLE001 - one playbook's failure is quarantined
            quarantine.add(str(path), line_no, PROCESSING_ERROR, f"scrub: {type(err).__name__}")
    return out


def consolidate(playbooks: list[dict], filters: PlaybookFilters) -> tuple[list[dict], dict]:
    """Merge playbooks of one agent, filter, keep the top K per domain; per-domain stats."""
    merged: dict[str, dict] = {}
    for pb in playbooks:
        if pb["agent_id"] in merged:
            merged[pb["agent_id"]] = _merge(merged[pb["agent_id"]], pb)
        else:
            merged[pb["agent_id"]] = dict(pb)
    by_domain: dict[str, list[dict]] = defaultdict(list)
    dropped = Counter()
    for pb in merged.values():
        if pb["graduation_score"] < filters.min_graduation_score:
            dropped[f"min_graduation_score={filters.min_graduation_score}"] += 1
        elif pb["interactions"] < filters.min_interactions:
            dropped[f"min_interactions={filters.min_interactions}"] += 1
        elif pb["success_rate"] < filters.min_success_rate:
            dropped[f"min_success_rate={filters.min_success_rate}"] += 1
        else:
            by_domain[pb["domain"]].append(pb)
    kept = []
    for domain in sorted(by_domain):
        ranked = sorted(by_domain[domain], key=lambda p: (-p["graduation_score"], p["agent_id"]))
        dropped[f"top_k_per_domain={filters.top_k_per_domain}"] += max(
            0, len(ranked) - filters.top_k_per_domain
        )
        kept += ranked[: filters.top_k_per_domain]
    return kept, {
        "playbooks_in": len(playbooks),
        "agents": len(merged),
        "kept": len(kept),
        "dropped_by_filter": dict(dropped),
        "per_domain": domain_stats(kept),
    }


def _merge(a: dict, b: dict) -> dict:
    """Two playbooks of one agent: interaction-weighted rates, entries of both."""
    n = a["interactions"] + b["interactions"]
    # validate() keeps interactions >= 1; equal weights if unvalidated playbooks have none
    wa, wb = (a["interactions"], b["interactions"]) if n > 0 else (1, 1)
    mix = lambda k: round((a[k] * wa + b[k] * wb) / (wa + wb), 4)  # noqa: E731
    return {
        **a,
        "interactions": n,
        "success_rate": mix("success_rate"),
        "graduation_score": mix("graduation_score"),
        "entries": a["entries"] + b["entries"],
    }


def domain_stats(playbooks: list[dict]) -> dict[str, dict]:
    """Per-domain quality statistics of the kept playbooks (the manifest's view)."""
    out = {}
    for domain in routing.DOMAINS:
        items = [p for p in playbooks if p["domain"] == domain]
        if not items:
            out[domain] = {"playbooks": 0}
            continue
        scores = sorted(p["graduation_score"] for p in items)
        out[domain] = {
            "playbooks": len(items),
            "interactions": sum(p["interactions"] for p in items),
            "mean_graduation_score": round(sum(scores) / len(scores), 4),
            "median_graduation_score": scores[len(scores) // 2],
            "mean_success_rate": round(sum(p["success_rate"] for p in items) / len(items), 4),
            "entries": sum(len(p["entries"]) for p in items),
        }
    return out


def render(playbook: dict) -> str:
    """The training text of a playbook: routing header, then its bullets by section."""
    lines = [
        f"<domain:{playbook['domain']}> <difficulty:{difficulty(playbook)}> "
        f"<playbook:{playbook['agent_id']}>",
        f"interactions {playbook['interactions']}, success rate {playbook['success_rate']:.2f}, "
        f"graduation score {playbook['graduation_score']:.2f}",
    ]
    for section in ("strategies", "common_mistakes", "code_snippets"):
        items = [e for e in playbook["entries"] if e.get("section") == section]
        if items:
            lines.append(f"### {section}")
            lines += [
                f"- {e['content']} (+{e.get('helpful', 0)}/-{e.get('harmful', 0)})" for e in items
            ]
    return "\n".join(lines)


def difficulty(playbook: dict) -> str:
    """A playbook that graduated high is a harder, denser text: more to learn from."""
    score = playbook["graduation_score"]
    return "hard" if score >= 0.7 else "medium" if score >= 0.4 else "easy"


def write(path: Path, playbooks: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for pb in playbooks:
            f.write(json.dumps(pb, ensure_ascii=False) + "\n")
