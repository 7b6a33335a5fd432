"""Quarantine for malformed input lines: kept in a file with the reason, counted per reason.

A bad line never stops a build; it is written to `<name>.quarantine.jsonl` beside the
outputs so it can be inspected, and the counts per reason go into the manifest.
"""

from __future__ import annotations

import json
import math
import re
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
OUT_OF_RANGE = "out_of_range"
TOO_DEEP = "too_deep"
# Deeper JSON is quarantined: nothing real nests this far, and deeper values would
# overflow the recursion of the code that reads them later.
MAX_DEPTH = 100
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

    def write(self, path: Path, root: Path | None = None) -> None:
        """One JSON line per entry; sources under `root` are written relative to it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for entry in self.entries:
                source = Path(entry["source"])
                if root is not None and source.is_relative_to(root):
                    entry = {**entry, "source": str(source.relative_to(root))}
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


def read_json_lines(path: Path, quarantine: Quarantine, max_line_bytes: int):
    """Yield (line_no, object) for every line of a JSONL file that is a JSON object.

    Each other line is quarantined with its reason: oversized, binary, truncated or
    invalid JSON, nested too deep, or not an object. An empty file is one quarantine entry.
    """
    source = str(path)
    any_line = False
    with open(path, "rb") as f:
        for line_no, raw, size in _bounded_lines(f, max_line_bytes):
            if size is not None:
                any_line = True
                quarantine.add(
                    source,
                    line_no,
                    OVERSIZED_LINE,
                    f"{size} bytes > max_line_bytes={max_line_bytes}",
                    raw,
                )
                continue
            if not raw.strip():
                continue
            any_line = True
            obj = _decode(raw, source, line_no, quarantine)
            if obj is not None:
                yield line_no, obj
    if not any_line:
        quarantine.add(source, 0, EMPTY_FILE, "the file has no lines")


def _bounded_lines(f, max_line_bytes: int):
    """(line_no, bytes, None) per line; an oversized line is (line_no, its head, its size).

    No more than max_line_bytes + 1 bytes of a line are ever held: the rest of a longer
    line is read in chunks and dropped.
    """
    line_no = 0
    while chunk := f.readline(max_line_bytes + 1):
        line_no += 1
        if chunk.endswith(b"\n") or len(chunk) <= max_line_bytes:
            yield line_no, chunk, None
            continue
        size, rest = len(chunk), b""
        while not rest.endswith(b"\n") and (rest := f.readline(1 << 16)):
            size += len(rest)
        yield line_no, chunk[:KEEP_CHARS], size - rest.endswith(b"\n")


class _NotJSON(ValueError):
    """NaN, Infinity or a number out of range: Python reads them, JSON (RFC 8259) has none."""


def _reject_constant(name: str):
    raise _NotJSON(f"{name} is not JSON")


def _loads(text: str):
    return json.loads(text, parse_constant=_reject_constant)


def _too_deep_or_non_finite(obj) -> str | None:
    """Why a parsed value cannot be used ('too_deep' / 'invalid_json' detail), else None."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                return f"{TOO_DEEP}: nested deeper than {MAX_DEPTH} levels"
            items = value.values() if isinstance(value, dict) else value
            stack += [(v, depth + 1) for v in items]
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{INVALID_JSON}: a number out of range ({value})"
    return None


def _decode(raw: bytes, source: str, line_no: int, quarantine: Quarantine):
    body = raw.rstrip(b"\r\n")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        # Cut inside a multi-byte character (the first bad byte is an unfinished one at the
        # end): the writer stopped mid-record if what comes before is a cut document.
        head = body[: err.start].decode("utf-8")
        if err.reason == "unexpected end of data" and head.strip() and looks_truncated(head):
            quarantine.add(source, line_no, TRUNCATED_JSON, "cut inside a UTF-8 character", raw)
        else:
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
        obj = _loads(text)
    except RecursionError:
        quarantine.add(source, line_no, TOO_DEEP, "nested too deep to parse", text)
        return None
    except _NotJSON as err:
        quarantine.add(source, line_no, INVALID_JSON, str(err), text)
        return None
    except json.JSONDecodeError as err:
        reason = TRUNCATED_JSON if looks_truncated(text) else INVALID_JSON
        quarantine.add(source, line_no, reason, f"{err.msg} at char {err.pos}", text)
        return None
    problem = _too_deep_or_non_finite(obj)
    if problem:
        reason, _, detail = problem.partition(": ")
        quarantine.add(source, line_no, reason, detail, text)
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


_LITERALS = ("true", "false", "null")
_LAST_WORD = re.compile(r"[A-Za-z0-9.+\-]*$")
# What a cut document may still need before its closing brackets: nothing, a value, the
# value of a key, a key and its value.
_FILLERS = ("", "null", ":null", '"":null')


def looks_truncated(text: str) -> bool:
    """Whether `text` is the start of a JSON document cut short (not a broken one).

    It is if it parses once its last token is completed (a literal, a number, an escape or
    a string) and what it opened is closed; a text that is wrong before its end never does.
    """
    closers, in_string, escape, hex_left = [], False, False, 0
    for ch in text:
        if in_string:
            if hex_left:
                hex_left -= 1
            elif escape:
                escape, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            closers.append("]" if ch == "[" else "}")
        elif ch in "]}" and (not closers or closers.pop() != ch):
            return False
    if in_string:
        head = (text[:-1] if escape else text) + "0" * hex_left + '"'
    else:
        head = text.rstrip()
        word = _LAST_WORD.search(head).group()
        literal = next((lit for lit in _LITERALS if word and lit.startswith(word)), None)
        if literal:
            head += literal[len(word) :]
        elif word[-1:] in ("-", "+", ".", "e", "E"):
            head += "0"
    tail = "".join(reversed(closers))
    for filler in _FILLERS:
        try:
            _loads(head + filler + tail)
            return True
        except (ValueError, RecursionError):
            continue
    return False
