"""Secret scrubbing: every text that becomes training data or lands on disk passes here.

Built on detect-secrets (Yelp's scanner, which security teams already run and keep up to
date), used as a library: its plugins find credentials with a known shape (AWS, GitHub,
GitLab, Slack, Stripe, OpenAI, JWT, npm, PyPI, SendGrid, Twilio, Mailchimp, Telegram,
Discord, Square, Artifactory, IBM, SoftLayer, Azure storage keys, private keys, URL
credentials) and keyword assignments (`password = "..."`); its heuristic filters drop
sequences, UUIDs, templates (`${X}`, `<x>`) and `$VAR` references. patterns.py adds only
what it lacks. A found value is widened to its whole token (a plugin that matches the
first 24 chars of a 99-char key would leave the tail), replaced by `<REDACTED:kind>`
wherever it stands in the text, and counted.
"""

from __future__ import annotations

import functools
import io
import re
import tokenize
from collections import Counter

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.filters import heuristic
from detect_secrets.plugins.base import RegexBasedDetector
from detect_secrets.plugins.keyword import KeywordDetector

from capibara_exp.data.e2b import patterns

# Plugins left out, and why.
_LEFT_OUT = {
    # They flag every hash, digest, id and base64 image that outputs are full of; a key
    # in a keyword context is found by the keyword detector without them.
    "Base64 High Entropy String",
    "Hex High Entropy String",
    # An address is not a credential, and doctests of ipaddress/socket print many.
    "Public IP (ipv4)",
}
# detect-secrets' filters used, and the ones not used: `is_line_allowlisted` (a pragma
# comment in untrusted input would let a secret through), `is_likely_id_string` (drops
# `password=` values after any `user_id=` on the line), `is_indirect_reference` (drops
# every value on a line that calls a function: `connect(password="x")`).
_FILTERS = (
    heuristic.is_sequential_string,
    heuristic.is_potential_uuid,
    heuristic.is_templated_secret,
    heuristic.is_prefixed_with_dollar_sign,
    heuristic.is_not_alphanumeric_string,
)
# detect-secrets' keyword detector picks its regexes by file name: with quotes required
# (Python's) for every line, as an unquoted `password = pw` in code is a variable.
_CODE_FILE = "cell.py"
# Characters a token is made of: a found value is widened over them.
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_\-]")
# Longer lines are scanned by the plugins in overlapping windows (their regexes are not
# linear on pathological lines); a credential is far shorter than the overlap.
_WINDOW, _OVERLAP = 4096, 512
# Values this long are also redacted where they stand again in the same text.
_PROPAGATE_CHARS = 8
MARK = "<REDACTED:"
# The name before a value: `name = "v"`, `"name": "v"`, `name => "v"`, `name := v`.
_KEY_BEFORE = r"([\w.\-]{1,80})['\"\]]{0,2}\s*(?:[:!=]=?=?|=>)\s*@?['\"`]?"


def _slug(secret_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", secret_type.lower()).strip("_")


@functools.cache
def _plugins() -> tuple:
    found = get_mapping_from_secret_type_to_class()
    return tuple((_slug(t), found[t]()) for t in sorted(found) if t not in _LEFT_OUT)


def plugin_names() -> list[str]:
    """The detect-secrets plugins in use (for the manifest)."""
    return [type(p).__name__ for _, p in _plugins()]


def _kept(value: str, own: bool = True) -> bool:
    """Not dropped by detect-secrets' filters, nor (own) by the project's placeholder,
    literal and reference checks."""
    if not value or any(f(value) for f in _FILTERS):
        return False
    return not (own and patterns.not_a_secret(value))


def _windows(line: str):
    if len(line) <= _WINDOW:
        yield line
        return
    for start in range(0, len(line), _WINDOW - _OVERLAP):
        yield line[start : start + _WINDOW]


def _plugin_values(line: str) -> dict[tuple[str, str], object]:
    """(kind, value, plugin) that detect-secrets' plugins report in a line (escaped quotes
    read as quotes)."""
    variants = {line, unescaped(line)}
    out = {}
    for variant in variants:
        for window in _windows(variant):
            for kind, plugin in _plugins():
                for found in plugin.analyze_line(filename=_CODE_FILE, line=window):
                    if found.secret_value:
                        out[(kind, found.secret_value)] = plugin
    return out


def _keyword_value_kept(line: str, value: str) -> bool:
    """The keyword detector's value, judged by the name it stands under (as the project's
    own patterns are): not a name about a credential (`secret_type = 'AWS Access Key'`),
    and a generated-looking value under a token/key name."""
    m = re.search(_KEY_BEFORE + re.escape(value), unescaped(line))
    key = m.group(1) if m else None
    if patterns.not_a_secret(value, key):
        return False
    rule = patterns.key_rule(key)
    return rule == "any" or (rule == "random" and patterns.looks_random(value))


def _plugin_spans(line: str, base: int, own: bool = True):
    """Spans of what the plugins found, each widened to its token and filtered.

    A regex plugin reports its first group, which for some (GitHub's) is only the prefix
    (`ghp`): the widened token must then match one of the plugin's own regexes.
    """
    for (kind, value), plugin in _plugin_values(line).items():
        if own and isinstance(plugin, KeywordDetector) and not _keyword_value_kept(line, value):
            continue
        prefix_only = len(value) < _PROPAGATE_CHARS and isinstance(plugin, RegexBasedDetector)
        for lo, hi in _occurrences(line, value):
            token = line[lo:hi]
            if prefix_only and not any(r.search(token) for r in plugin.denylist):
                continue
            if _kept(token, own):
                yield base + lo, base + hi, kind


def _occurrences(text: str, value: str, start: int = 0, end: int | None = None):
    """Spans of `value` in text[start:end], widened over token characters."""
    end = len(text) if end is None else end
    at = text.find(value, start, end)
    while at != -1:
        lo, hi = at, at + len(value)
        while lo > start and _TOKEN_CHARS.match(text[lo - 1]):
            lo -= 1
        while hi < end and _TOKEN_CHARS.match(text[hi]):
            hi += 1
        if MARK not in text[max(0, lo - len(MARK)) : hi]:
            yield lo, hi
        at = text.find(value, at + len(value), end)


def _python_strings(code: str) -> list[tuple[int, int]]:
    starts = [0]
    for line in code.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING:
                out.append(
                    (starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1])
                )
    except (tokenize.TokenError, SyntaxError):
        pass  # code that does not tokenize: the strings read so far
    return out


_QUOTES = {"javascript": ("'\"`", "//"), "sql": ("'\"", "--")}


def _quoted(code: str, language: str) -> list[tuple[int, int]]:
    """String literal spans of JavaScript or SQL (quotes, escapes, line comments)."""
    quotes, comment = _QUOTES[language]
    out, i, n = [], 0, len(code)
    while i < n:
        ch = code[i]
        if code.startswith(comment, i):
            i = code.find("\n", i)
            i = n if i == -1 else i
        elif ch in quotes:
            j = i + 1
            while j < n and code[j] != ch:
                j += 2 if code[j] == "\\" else 1
            out.append((i, min(j + 1, n)))
            i = j + 1
        else:
            i += 1
    return out


def string_spans(code: str, language: str | None) -> list[tuple[int, int]]:
    """Where a cell's string literals are: their text is data (settings, DSNs, SQL), not code."""
    if language == "python":
        return _python_strings(code)
    return _quoted(code, language) if language in _QUOTES else []


def unescaped(line: str) -> str:
    """A line with escaped quotes as quotes (`{\\"password\\": \\"x\\"}` printed inside a
    string): what is found there is then looked for in the line as it stands."""
    return line.replace('\\"', '"').replace("\\'", "'") if "\\" in line else line


def _pattern_spans(line: str, base: int, in_code):
    for kind, pattern, check in patterns.LINE_PATTERNS:
        for m in pattern.finditer(line):
            group = "secret" if "secret" in pattern.groupindex else 0
            value, key = m.group(group), m.groupdict().get("key")
            if patterns.not_a_secret(value, key) or not _kept(value):
                continue
            if check == "unquoted" and patterns.code_value(value, in_code(base + m.start(group))):
                continue  # `password = new_password`: a variable
            rule = "random" if check == "random" else patterns.key_rule(key)
            if rule == "none" or (rule == "random" and not patterns.looks_random(value)):
                continue
            yield base + m.start(group), base + m.end(group), kind


def _spans(text: str, language: str | None, own: bool) -> list[tuple[int, int, str]]:
    spans = list(patterns.block_spans(text)) if own else []
    strings = string_spans(text, language) if language else []

    def in_code(pos: int) -> bool:
        return language is not None and not any(lo <= pos < hi for lo, hi in strings)

    base = 0
    for line in text.split("\n"):
        spans += _plugin_spans(line, base, own)
        if own:
            spans += _pattern_spans(line, base, in_code)
        if own and (plain := unescaped(line)) != line:  # inside a string: no code there
            for start, end, kind in _pattern_spans(plain, 0, lambda _: False):
                found = _occurrences(line, plain[start:end])
                spans += [(base + lo, base + hi, kind) for lo, hi in found]
        base += len(line) + 1
    return spans


def _merge(spans: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    merged: list[list] = []
    for start, end, kind in sorted(spans, key=lambda s: (s[0], -s[1])):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, kind])
    return [tuple(s) for s in merged]


def _redact(text: str, spans, counts: Counter) -> tuple[str, set[str]]:
    out, last, values = [], 0, set()
    for start, end, kind in spans:
        out += [text[last:start], f"{MARK}{kind}>"]
        values.add((text[start:end], kind))
        counts[kind] += 1
        last = end
    out.append(text[last:])
    return "".join(out), values


def redact_values(text: str, values, counts: Counter) -> str:
    """Replace known secret values (long enough to be unambiguous) wherever they stand."""
    spans = [
        (lo, hi, kind)
        for value, kind in values
        if len(value) >= _PROPAGATE_CHARS
        for lo, hi in _occurrences(text, value)
    ]
    return _redact(text, _merge(spans), counts)[0] if spans else text


def scrub_text(
    text: str, language: str | None = None, own: bool = True
) -> tuple[str, dict[str, int]]:
    """The text with every secret found replaced, and the count per kind.

    `language` (python, sql, javascript) marks the text as code: an unquoted setting
    line there is a variable assignment, not a credential, unless it is inside a string.
    """
    found, _ = scrub_with_values(text, language, own)
    return found[0], dict(found[1])


def scrub_with_values(text: str, language: str | None = None, own: bool = True):
    """((scrubbed text, counts), the secret values found) for propagating to other fields.

    `own=False` runs detect-secrets alone (the benchmark's baseline)."""
    counts: Counter = Counter()
    scrubbed, values = _redact(text, _merge(_spans(text, language, own)), counts)
    scrubbed = redact_values(scrubbed, values, counts)
    return (scrubbed, counts), values


def _strings(obj, path=()):
    if isinstance(obj, str):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, (*path, i))


def _rebuild(obj, new: dict, path=()):
    if isinstance(obj, str):
        return new.get(path, obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, new, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, new, (*path, i)) for i, v in enumerate(obj)]
    return obj


def scrub_tree(obj, code_paths: dict[tuple, str] | None = None) -> tuple[object, dict[str, int]]:
    """Every string of a JSON value scrubbed (the strings at `code_paths` as code in their
    language); a secret found in one string is also redacted in every other (a password in
    the code, printed again on stdout)."""
    code_paths = code_paths or {}
    counts: Counter = Counter()
    found: set = set()
    new = {}
    for path, text in _strings(obj):
        (scrubbed, n), values = scrub_with_values(text, code_paths.get(path))
        counts.update(n)
        found |= values
        new[path] = scrubbed
    if found:
        new = {path: redact_values(text, found, counts) for path, text in new.items()}
    return _rebuild(obj, new), dict(counts)
