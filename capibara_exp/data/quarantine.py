"""Quarantine for malformed input lines: kept in a file with the reason, counted per reason.

A bad line never stops a build; it is written to `<name>.quarantine.jsonl` beside the
outputs so it can be inspected, and the counts per reason go into the manifest.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

# Reasons a line is quarantined (stable names: they are manifest keys).
EMPTY_FILE = "empty_file"
OVERSIZED_LINE = "oversized_line"
BINARY_GARBAGE = "binary_garbage"
TRUNCATED_JSON = "truncated_json"
INVALID_JSON = "invalid_json"
WRONG_TYPE = "wrong_type"
MISSING_FIELD = "missing_field"
# How much of a bad line the quarantine file keeps (a 10 MB line stays a pointer, not a copy).
KEEP_CHARS = 2000


class Quarantine:
    """Collects bad lines with their reason; `write` puts them in one JSONL file."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.entries: list[dict] = []

    def add(
        self, source: str, line_no: int, reason: str, detail: str, raw: bytes | str = b""
    ) -> None:
        if isinstance(raw, bytes):
            raw = raw[:KEEP_CHARS].decode("utf-8", errors="backslashreplace")
        self.counts[reason] += 1
        self.entries.append(
            {
                "source": source,
                "line": line_no,
                "reason": reason,
                "detail": detail,
                "raw": raw[:KEEP_CHARS],
            }
        )

    def merge(self, other: Quarantine) -> None:
        self.counts.update(other.counts)
        self.entries += other.entries

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for entry in self.entries:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


def read_json_lines(path: Path, quarantine: Quarantine, max_line_bytes: int):
    """Yield (line_no, object) for every line of a JSONL file that is a JSON object.

    Each other line is quarantined with its reason: oversized, binary, truncated or
    invalid JSON, or not an object. An empty file is one quarantine entry.
    """
    source = str(path)
    any_line = False
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            any_line = True
            obj = _decode(raw, source, line_no, quarantine, max_line_bytes)
            if obj is not None:
                yield line_no, obj
    if not any_line:
        quarantine.add(source, 0, EMPTY_FILE, "the file has no lines")


def _decode(raw: bytes, source: str, line_no: int, quarantine: Quarantine, max_line_bytes: int):
    if len(raw) > max_line_bytes:
        quarantine.add(
            source,
            line_no,
            OVERSIZED_LINE,
            f"{len(raw)} bytes > max_line_bytes={max_line_bytes}",
            raw,
        )
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        quarantine.add(
            source, line_no, BINARY_GARBAGE, f"not UTF-8: {err.reason} at byte {err.start}", raw
        )
        return None
    if "\x00" in text or sum(not c.isprintable() and c not in "\r\n\t" for c in text) > 0.1 * len(
        text
    ):
        quarantine.add(source, line_no, BINARY_GARBAGE, "control characters: not a text line", raw)
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        # An error at the very end of the line means the writer stopped mid-record.
        reason = TRUNCATED_JSON if err.pos >= len(text.rstrip()) else INVALID_JSON
        quarantine.add(source, line_no, reason, f"{err.msg} at char {err.pos}", text)
        return None
    if not isinstance(obj, dict):
        quarantine.add(
            source,
            line_no,
            WRONG_TYPE,
            f"a line must be a JSON object, got {type(obj).__name__}",
            text,
        )
        return None
    return obj
