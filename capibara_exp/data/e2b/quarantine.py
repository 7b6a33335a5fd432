"""Quarantine for bad input lines: their reason, where they are, and no secret.

A bad line never stops a build. Its entry in `<name>.quarantine.jsonl` says which file
and line, the reason, a detail naming the JSON path (never the value), the line's size
and the char offset of the problem, and a short excerpt for a reader to recognise it.
The excerpt is scrubbed like training text, tokens cut at its edges are dropped, and
every long random-looking run left is masked: a quarantine file holds no secret.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from capibara_exp.data.e2b import scrub

# How much of a bad line its entry shows, around the problem (or from the start).
EXCERPT_CHARS = 240
# How much of the line around the excerpt the detector reads for cues.
CONTEXT_CHARS = 2048
# Runs that could be a key, token or password cut by the window: masked. Hashes and ids
# get masked too; the excerpt is for recognising a line, not for reading its data.
_TOKEN_RUN = re.compile(r"[A-Za-z0-9+/=_\-.~]{16,}")


def _mask_run(match: re.Match) -> str:
    run = match.group()
    if run.isalpha() or run.isdigit() or "REDACTED" in run:
        return run
    return f"<MASKED:{len(run)} chars>"


# JSON's escapes of line breaks, tabs and quotes, read as what they stand for: the
# scrubber reads settings and quoted values line by line.
_ESCAPES = {"\\n": "\n", "\\t": "\t", '\\"': '"', "\\/": "/", "\\\\": "\\"}
_ESCAPE = re.compile(r'\\[nt"/\\]|\\u[0-9a-fA-F]{4}')


def _unescape(match: re.Match) -> str:
    text = match.group()
    if text in _ESCAPES:
        return _ESCAPES[text]
    ch = chr(int(text[2:], 16))
    return text if "\ud800" <= ch <= "\udfff" else ch  # half a pair stays escaped


def excerpt(raw: bytes | str, offset: int | None = None) -> str:
    """A scrubbed, masked window of a bad line around `offset` (chars; bytes for raw bytes),
    with JSON's common escapes read as the characters they stand for. The detector reads a
    wider window first, so a secret whose cue the excerpt cuts off is still redacted."""
    if isinstance(raw, bytes):
        raw = raw.rstrip(b"\r\n").decode("utf-8", "backslashreplace")
    text = raw
    start = max(0, (offset or 0) - EXCERPT_CHARS // 2) if offset else 0
    end = min(len(text), start + EXCERPT_CHARS)
    wide = text[max(0, start - CONTEXT_CHARS) : end + CONTEXT_CHARS]
    _, found = scrub.scrub_with_values(_ESCAPE.sub(_unescape, wide))
    window = text[start:end]
    # A token cut by the window edge is no longer recognisable as a secret: drop it.
    if start > 0:
        window = "…" + re.sub(r"^\S*\s?", "", window, count=1)
    if end < len(text):
        window = re.sub(r"\s?\S*$", "", window, count=1) + "…"
    window = scrub.scrub_text(_ESCAPE.sub(_unescape, window))[0]
    window = scrub.redact_values(window, found, Counter())
    return _TOKEN_RUN.sub(_mask_run, window)


class Quarantine:
    """Collects bad lines with their reason; `write` puts them in one JSONL file."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.entries: list[dict] = []

    def add(
        self,
        source: str,
        line_no: int,
        reason: str,
        detail: str,
        raw: bytes | str = b"",
        offset: int | None = None,
    ) -> None:
        self.counts[reason] += 1
        self.entries.append(
            {
                "source": source,
                "line": line_no,
                "reason": reason,
                "detail": scrub.scrub_text(detail)[0],
                "bytes": len(raw.encode("utf-8", "replace") if isinstance(raw, str) else raw),
                "offset": offset,
                "excerpt": excerpt(raw, offset) if raw else "",
            }
        )

    def merge(self, other: Quarantine) -> None:
        self.counts.update(other.counts)
        self.entries += other.entries

    def per_source(self) -> dict[str, Counter]:
        """Reasons counted per input file."""
        out: dict[str, Counter] = {}
        for entry in self.entries:
            out.setdefault(entry["source"], Counter())[entry["reason"]] += 1
        return out

    def write(self, path: Path, root: Path | None = None) -> None:
        """One JSON line per entry; sources under `root` are written relative to it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", errors="backslashreplace") as f:
            for entry in self.entries:
                source = Path(entry["source"])
                if root is not None and source.is_relative_to(root):
                    entry = {**entry, "source": str(source.relative_to(root))}
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))
