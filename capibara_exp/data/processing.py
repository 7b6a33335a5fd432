"""Execution records -> clean examples: detect, featurise, score, filter, dedup, scrub.

Scrubbing comes before anything else is derived from the text, so a secret never reaches
an example, a playbook or a hash. Every filter counts what it dropped; if nothing is left
`NoExamplesError` names the filters and their settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter
from collections.abc import Iterable

from capibara_exp.data import features, secrets
from capibara_exp.data.e2b_records import ExecutionRecord


class NoExamplesError(ValueError):
    """Every record was filtered out."""


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which records become examples (conf/data_build.yaml: filters)."""

    languages: tuple[str, ...] = ("python", "sql", "javascript")
    min_quality: float = 0.0
    min_code_chars: int = 8
    max_code_chars: int = 4000
    require_success: bool = False
    drop_sandbox_errors: bool = True
    dedup: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> Filters:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"filters: unknown key(s) {sorted(unknown)} "
                f"(known: {[f.name for f in dataclasses.fields(cls)]})"
            )
        return cls(**{k: tuple(v) if k == "languages" else v for k, v in d.items()})


def normalised_hash(code: str, language: str) -> str:
    """Hash of the code with comments, case (SQL) and whitespace runs normalised away."""
    comment = {"python": r"(?m)#.*$", "sql": r"(?m)--.*$", "javascript": r"(?m)//.*$"}[language]
    text = re.sub(comment, "", code)
    text = text.lower() if language == "sql" else text
    text = " ".join(text.split())
    return hashlib.sha256(f"{language}\0{text}".encode()).hexdigest()


def _error_text(record: ExecutionRecord) -> str:
    err = record.execution.error
    if err is None:
        return ""
    return f"{err.name}: {err.value}".strip()


def to_example(record: ExecutionRecord) -> tuple[dict, Counter]:
    """One scrubbed example with its features and scores, and what scrubbing found."""
    found: Counter = Counter()
    texts = {}
    for key, raw in (
        ("code", record.code),
        ("output", record.output_text),
        ("error", _error_text(record)),
        ("expected", record.expected_output or ""),
    ):
        texts[key], counts = secrets.scrub(raw)
        found.update(counts)
    feats = features.code_features(texts["code"], record.language)
    return {
        "id": record.id,
        "language": record.language,
        "detected_language": features.detect_language(texts["code"]),
        "source": record.source,
        "code": texts["code"],
        "output": texts["output"],
        "error": texts["error"],
        "error_name": record.execution.error.name if record.execution.error else "",
        "succeeded": record.succeeded,
        "features": feats,
        "expected_match": features.expected_match(record),
        "quality": features.quality_score(record, feats),
        "difficulty": features.difficulty_bucket(feats, record.succeeded),
        "duration_ms": record.duration_ms,
        "hash": normalised_hash(texts["code"], record.language),
    }, found


def _drop_reason(ex: dict, filters: Filters) -> str | None:
    if ex["language"] not in filters.languages:
        return f"languages={list(filters.languages)}"
    if len(ex["code"]) < filters.min_code_chars:
        return f"min_code_chars={filters.min_code_chars}"
    if len(ex["code"]) > filters.max_code_chars:
        return f"max_code_chars={filters.max_code_chars}"
    if filters.drop_sandbox_errors and ex["error_name"] == "SandboxError":
        return "drop_sandbox_errors=True"
    if filters.require_success and not ex["succeeded"]:
        return "require_success=True"
    if ex["quality"] < filters.min_quality:
        return f"min_quality={filters.min_quality}"
    return None


def process(records: Iterable[ExecutionRecord], filters: Filters) -> tuple[list[dict], dict]:
    """Examples that pass the filters (first of each normalised hash) and the build stats."""
    examples, seen = [], set()
    dropped: Counter = Counter()
    secrets_found: Counter = Counter()
    n_in = 0
    for record in records:
        n_in += 1
        ex, found = to_example(record)
        secrets_found.update(found)
        reason = _drop_reason(ex, filters)
        if reason is None and filters.dedup and ex["hash"] in seen:
            reason = "dedup=True"
        if reason:
            dropped[reason] += 1
            continue
        seen.add(ex["hash"])
        examples.append(ex)
    if not examples:
        detail = (
            ", ".join(f"{k} dropped {v}" for k, v in dropped.most_common()) or "no input records"
        )
        raise NoExamplesError(
            f"0 of {n_in} execution records passed the filters ({detail}); "
            f"filters: {dataclasses.asdict(filters)}"
        )
    stats = {
        "records_in": n_in,
        "examples_out": len(examples),
        "dropped_by_filter": dict(dropped),
        "secrets_scrubbed": dict(secrets_found),
        "languages": dict(Counter(e["language"] for e in examples)),
        "language_detection_agreement": round(
            sum(e["detected_language"] == e["language"] for e in examples) / len(examples), 4
        ),
        "success_rate": round(sum(e["succeeded"] for e in examples) / len(examples), 4),
        "mean_quality": round(sum(e["quality"] for e in examples) / len(examples), 4),
    }
    return examples, stats
