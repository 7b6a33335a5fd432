"""Execution records -> clean examples: scrub, featurise, score, filter, dedup.

Scrubbing comes before anything is derived from a record, so a secret never reaches an
example, a playbook, an id or a hash. A record that fails at any step (scrub, features,
dedup key, encoding) is quarantined with the step and the error's type and the build goes
on. Every filter counts what it dropped, per input file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable

from capibara_exp.base.errors import ConfigError
from capibara_exp.data.e2b import features, records, scrub
from capibara_exp.data.e2b.quarantine import Quarantine
from capibara_exp.data.e2b.reasons import PROCESSING_ERROR
from capibara_exp.data.e2b.records import ExecutionRecord

# What a dedup key may be made of (filters.dedup): the code (comments, case of SQL and
# whitespace normalised away), stdout, stderr, the results' text, the error's name and
# value. The default is all of them: a re-run of the same code with another outcome is
# another example.
DEDUP_FIELDS = ("code", "stdout", "stderr", "results", "error")


class NoExamplesError(ConfigError):
    """Every record was filtered out (the filters are the user's to change)."""


class _StepFailed(Exception):
    def __init__(self, step: str, error: BaseException):
        super().__init__(f"{step}: {type(error).__name__}")


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which records become examples (conf/data_build.yaml: filters)."""

    languages: tuple[str, ...] = ()  # () keeps every language
    min_quality: float = 0.0
    min_code_chars: int = 8
    max_code_chars: int = 4000
    require_success: bool = False
    drop_sandbox_errors: bool = True
    dedup: tuple[str, ...] = DEDUP_FIELDS

    @classmethod
    def from_dict(cls, d: dict) -> Filters:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = set(d) - set(known)
        if unknown:
            raise ConfigError(f"filters: unknown key(s) {sorted(unknown)} (known: {known})")
        dedup = d.get("dedup", list(DEDUP_FIELDS))
        if not isinstance(dedup, list | tuple) or set(dedup) - set(DEDUP_FIELDS):
            raise ConfigError(
                f"filters.dedup must be a list of fields from {list(DEDUP_FIELDS)} "
                f"([] turns dedup off), got {dedup!r}"
            )
        languages = d.get("languages") or ()
        names = isinstance(languages, list | tuple) and all(isinstance(x, str) for x in languages)
        if not names:
            raise ConfigError(f"filters.languages must be null or a list of names: {languages!r}")
        return cls(**{**d, "languages": tuple(languages), "dedup": tuple(dedup)})


_LINE_COMMENT = {
    "python": r"(?m)#.*$", "r": r"(?m)#.*$", "bash": r"(?m)#.*$", "sh": r"(?m)#.*$",
    "sql": r"(?m)--.*$", "javascript": r"(?m)//.*$", "typescript": r"(?m)//.*$",
    "java": r"(?m)//.*$",
}


def normalised_code(code: str, language: str) -> str:
    """The code with comments (of the languages whose comments are known), case (SQL) and
    whitespace runs normalised away."""
    comment = _LINE_COMMENT.get(language.lower())
    text = re.sub(comment, "", code) if comment else code
    text = text.lower() if language == "sql" else text
    return " ".join(text.split())


def dedup_key(ex: dict, fields: tuple[str, ...]) -> str:
    parts = {
        "code": lambda: normalised_code(ex["code"], ex["language"]),
        "stdout": lambda: " ".join(ex["stdout"].split()),
        "stderr": lambda: " ".join(ex["stderr"].split()),
        "results": lambda: "\0".join(ex["results"]),
        "error": lambda: (
            "" if ex["error"] is None else ex["error"]["name"] + "\0" + ex["error"]["value"]
        ),
    }
    text = "\1".join(f"{f}={parts[f]()}" for f in fields)
    return hashlib.sha256(f"{ex['language']}\0{text}".encode()).hexdigest()


def scrubbed_record(record: ExecutionRecord) -> tuple[ExecutionRecord, dict[str, int]]:
    """The record with every string scrubbed, and its id (a content hash if it had none)."""
    obj, counts = scrub.scrub_tree(record.to_json(), {("code",): record.language})
    clean = records.from_nested(obj, record.origin, record.shape)
    if clean.id is None:
        body = json.dumps({**obj, "id": None}, sort_keys=True, ensure_ascii=False)
        clean.id = "sha256-" + hashlib.sha256(body.encode()).hexdigest()[:24]
    return clean, counts


def to_example(record: ExecutionRecord, derived_id: bool) -> dict:
    """One example (of a scrubbed record) with its features and scores."""
    ex = record.execution
    feats = features.code_features(record.code, record.language)
    return {
        "id": record.id,
        "id_derived": derived_id,
        "language": record.language,
        "detected_language": features.detect_language(record.code),
        "source": record.source,
        "origin": {"file": record.origin[0], "line": record.origin[1]},
        "code": record.code,
        "stdout": record.stdout,
        "stderr": record.stderr,
        "results": [r.text for r in ex.results if r.text],
        "output": record.output_text,
        "error": None
        if ex.error is None
        else {"name": ex.error.name, "value": ex.error.value, "traceback": ex.error.traceback},
        "expected_output": record.expected_output,
        "succeeded": record.succeeded,
        "features": feats,
        "expected_match": features.expected_match(record),
        "quality": features.quality_score(record, feats),
        "difficulty": features.difficulty_bucket(feats, record.succeeded),
        "duration_ms": record.duration_ms,
    }


def _drop_reason(ex: dict, filters: Filters) -> str | None:
    if filters.languages and ex["language"] not in filters.languages:
        return f"languages={list(filters.languages)}"
    if len(ex["code"]) < filters.min_code_chars:
        return f"min_code_chars={filters.min_code_chars}"
    if len(ex["code"]) > filters.max_code_chars:
        return f"max_code_chars={filters.max_code_chars}"
    if filters.drop_sandbox_errors and ex["error"] and ex["error"]["name"] == "SandboxError":
        return "drop_sandbox_errors=True"
    if filters.require_success and not ex["succeeded"]:
        return "require_success=True"
    if ex["quality"] < filters.min_quality:
        return f"min_quality={filters.min_quality}"
    return None


def _example(record: ExecutionRecord, filters: Filters) -> tuple[dict, dict]:
    """(example, secrets found); raises with the step it failed in (`err.step`)."""
    step = "scrub"
    try:
        clean, found = scrubbed_record(record)
        step = "features"
        ex = to_example(clean, derived_id=record.id is None)
        step = "dedup"
        ex["hash"] = dedup_key(ex, filters.dedup or DEDUP_FIELDS)
        step = "encode"
        json.dumps(ex, ensure_ascii=False).encode("utf-8")
        return ex, found
    except Exception as err:  # any failure on one record is that record's, not the build's
        raise _StepFailed(step, err) from err


def process(
    recs: Iterable[ExecutionRecord], filters: Filters, quarantine: Quarantine
) -> tuple[list[dict], dict]:
    """Examples that pass the filters (first of each dedup key) and the build stats (counts
    per input file under `per_file`)."""
    examples, seen = [], set()
    dropped: Counter = Counter()
    secrets_found: Counter = Counter()
    per_file: dict[str, Counter] = defaultdict(Counter)
    n_in = 0
    for record in recs:
        n_in += 1
        file, line = record.origin
        per_file[file]["accepted"] += 1
        try:
            ex, found = _example(record, filters)
        except _StepFailed as err:  # the step and the error's type, never its message
            quarantine.add(file, line, PROCESSING_ERROR, str(err))
            per_file[file]["accepted"] -= 1
            continue
        secrets_found.update(found)
        reason = _drop_reason(ex, filters)
        if reason:
            dropped[reason] += 1
            per_file[file]["filtered"] += 1
        elif filters.dedup and ex["hash"] in seen:
            dropped["dedup"] += 1
            per_file[file]["deduplicated"] += 1
        else:
            seen.add(ex["hash"])
            examples.append(ex)
            per_file[file]["examples"] += 1
    return examples, _stats(examples, n_in, dropped, secrets_found, per_file)


def _stats(examples, n_in, dropped, secrets_found, per_file) -> dict:
    n_out = max(1, len(examples))
    return {
        "records_in": n_in,
        "examples_out": len(examples),
        "dropped_by_filter": dict(dropped),
        "secrets_scrubbed": dict(sorted(secrets_found.items())),
        "per_file": {f: dict(c) for f, c in per_file.items()},
        "languages": dict(Counter(e["language"] for e in examples)),
        "language_detection_agreement": round(
            sum(e["detected_language"] == e["language"] for e in examples) / n_out, 4
        ),
        "success_rate": round(sum(e["succeeded"] for e in examples) / n_out, 4),
        "mean_quality": round(sum(e["quality"] for e in examples) / n_out, 4),
    }
