"""Secret scrubbing: every text that becomes training data or lands on disk passes here.

A credential is found by where it stands, not by a list of formats: a cue (a key,
column or flag name in any case and language, an auth header, a login subcommand, the
callee of a call, a line about failed authentication, a table's header, a key block's
armour, a Kubernetes Secret) combined with the value's shape (generated or chosen, see
shape.py), with base64 decoded where a secret hides. Provider formats (detect-secrets'
plugins, and the project's regexes where it has none) are one more signal. Placeholders,
references, public keys and hashes or UUIDs without a cue are kept (keep.py). Found values
become `<REDACTED:kind>` wherever they stand in the text, and in every other string of
the same record.

Modules: names (cue words), shape (generated or not), keep (never secret), contexts
(key-first and value-first reading of a line), forms (URLs, tools' flags, SQL clauses),
blocks (key blocks, encodings, Kubernetes Secrets), tables, formats (providers),
syntax (strings and comments of code), engine (find, redact), baseline (detect-secrets
alone, for the benchmark).
"""

from __future__ import annotations

from collections import Counter

from capibara_exp.data.e2b.scrub import baseline, engine, formats
from capibara_exp.data.e2b.scrub.engine import MARK, redact_values

__all__ = ["MARK", "plugin_names", "redact_values", "scrub_text", "scrub_tree", "scrub_with_values"]


def plugin_names() -> list[str]:
    """The detect-secrets plugins in use (for the manifest)."""
    return formats.plugin_names()


def scrub_with_values(
    text: str, language: str | None = None, own: bool = True, exclude=frozenset()
):
    """((scrubbed text, counts), the secret values found) for propagating to other fields.

    `language` marks the text as a cell's code in that language; `own=False` runs
    detect-secrets alone (the benchmark's baseline); `exclude` leaves provider families
    out (formats.FAMILY_NAMES: the leave-one-family-out evaluation)."""
    if own:
        return engine.scrub_with_values(text, language, frozenset(exclude))
    counts: Counter = Counter()
    scrubbed, values = engine.redact(text, engine.merge(baseline.find(text)), counts)
    return (engine.redact_values(scrubbed, values, counts), counts), values


def scrub_text(
    text: str, language: str | None = None, own: bool = True, exclude=frozenset()
) -> tuple[str, dict[str, int]]:
    """The text with every secret found replaced, and the count per kind."""
    (scrubbed, counts), _ = scrub_with_values(text, language, own, exclude)
    return scrubbed, dict(counts)


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
