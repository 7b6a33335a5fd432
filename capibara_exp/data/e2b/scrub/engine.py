"""Find every secret in a text and redact it; the same for every string of a record.

The text is read through a shadow of the same length (ANSI colour codes blanked, escaped
quotes and `\\n` escapes read as what they stand for), so what is found in a JSON string
printed inside a log is redacted where it stands. Lines without a credential cue and
without a long token are skipped: most lines of an execution log hold neither.
"""

from __future__ import annotations

import re
from collections import Counter

from capibara_exp.data.e2b.scrub import (
    blocks,
    contexts,
    formats,
    forms,
    keep,
    prefilter,
    syntax,
    tables,
)

MARK = contexts.REDACTED
# Values this long are also redacted where they stand again.
PROPAGATE_CHARS = 8
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
_ESCAPES = re.compile(r"\\[\"'nrt]")
_ESCAPED = {'\\"': ' "', "\\'": " '", "\\n": " \n", "\\r": "  ", "\\t": "  "}
# Provider formats are generated tokens (or URL credentials): lines without one are not
# given to detect-secrets' plugins.
_PLUGIN_RUN = re.compile(r"[A-Za-z0-9_\-+/]{16,}")
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_\-]")


def shadow(text: str) -> str:
    """The text as the detectors read it: same length, same offsets."""
    if "\x1b" in text:
        text = _ANSI.sub(lambda m: " " * len(m.group()), text)
    if "\\" in text:
        text = _ESCAPES.sub(lambda m: _ESCAPED[m.group()], text)
    return text


def _line_spans(line: str, base: int, code, exclude, cue: bool, long_run: bool) -> list:
    def in_code(pos: int) -> bool:
        return code(base + pos)

    found = []
    if long_run and (_PLUGIN_RUN.search(line) or "://" in line):
        found += [
            s for s in formats.spans(line, exclude) if not keep.not_a_secret(line[s[0] : s[1]])
        ]
    found += contexts.value_first(line, in_code, exclude)
    if cue:
        found += contexts.key_first(line, in_code)
        found += forms.urls(line) + forms.tools(line) + forms.sql(line)
    return [(base + lo, base + hi, kind) for lo, hi, kind in found]


def _structures(view: str, lowered: str, language, cue_lines, starts, exclude, depth) -> list:
    """Secrets that span lines: key blocks, encodings, Kubernetes Secrets, name/value
    pairs, tables, SQL inserts."""
    found = blocks.key_blocks(view) if ("----" in view or "putty" in lowered) else []
    if depth == 0:
        found += blocks.encoded(view, lowered, lambda plain: bool(find(plain, None, exclude, 1)))
    found += blocks.kubernetes_secrets(view) if "secret" in lowered else []
    found += blocks.name_value_pairs(view, lowered) if "alue" in lowered else []
    if language is None or language.lower() in syntax.SHELLS:
        found += tables.text_tables(
            view, cue_lines | prefilter.lines_with(view, lowered, starts, ("value",))
        )
    found += tables.html_tables(view) if "<t" in lowered else []
    found += tables.sql_inserts(view) if "insert" in lowered else []
    return found


def find(text: str, language: str | None = None, exclude=frozenset(), depth: int = 0) -> list:
    """(start, end, kind) of every secret found in `text` (code in `language` if given)."""
    view = shadow(text)
    lowered, starts = prefilter.lower(view), prefilter.line_starts(view)
    cue_lines = prefilter.lines_with(view, lowered, starts)
    long_lines = prefilter.long_run_lines(view, starts)
    code = syntax.in_code(view, language)
    found = _structures(view, lowered, language, cue_lines, starts, exclude, depth)
    for i in sorted(cue_lines | long_lines):
        end = starts[i + 1] - 1 if i + 1 < len(starts) else len(view)
        line = view[starts[i] : end]
        found += _line_spans(line, starts[i], code, exclude, i in cue_lines, i in long_lines)
    return found


def merge(spans: list) -> list[tuple[int, int, str]]:
    merged: list[list] = []
    for start, end, kind in sorted(spans, key=lambda s: (s[0], -s[1])):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, kind])
    return [tuple(s) for s in merged]


def redact(text: str, spans, counts: Counter) -> tuple[str, set]:
    out, last, values = [], 0, set()
    for start, end, kind in spans:
        out += [text[last:start], f"{MARK}{kind}>"]
        values.add((text[start:end], kind))
        counts[kind] += 1
        last = end
    out.append(text[last:])
    return "".join(out), values


def occurrences(text: str, value: str):
    """Spans of `value` in text, widened over token characters, not inside a redaction."""
    at = text.find(value)
    while at != -1:
        lo, hi = at, at + len(value)
        while lo > 0 and _TOKEN_CHARS.match(text[lo - 1]):
            lo -= 1
        while hi < len(text) and _TOKEN_CHARS.match(text[hi]):
            hi += 1
        if MARK not in text[max(0, lo - len(MARK)) : hi]:
            yield lo, hi
        at = text.find(value, at + len(value))


def redact_values(text: str, values, counts: Counter) -> str:
    """Replace known secret values (long enough to be unambiguous) wherever they stand."""
    spans = [
        (lo, hi, kind)
        for value, kind in values
        if len(value) >= PROPAGATE_CHARS
        for lo, hi in occurrences(text, value)
    ]
    return redact(text, merge(spans), counts)[0] if spans else text


def scrub_with_values(text: str, language: str | None = None, exclude=frozenset()):
    """((scrubbed text, counts), the secret values found) for propagating to other fields."""
    counts: Counter = Counter()
    spans = merge(find(text, language, exclude)) if len(text) >= 8 else []
    scrubbed, values = redact(text, spans, counts)
    scrubbed = redact_values(scrubbed, values, counts)
    return (scrubbed, counts), values
