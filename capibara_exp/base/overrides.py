"""Hydra override strings built from Python values (the sweeper's trials, T5X's flags)."""

from __future__ import annotations

import re
from collections.abc import Sequence

_PLAIN = re.compile(r"^[\w.\-/]+$")


def quote(value: str) -> str:
    """A string as a quoted Hydra override value that parses back to exactly `value`.

    In Hydra's grammar a backslash is literal except before a quote or at the end of the
    string, where it must be doubled; a quote is escaped with a backslash."""
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value).replace("'", "\\'")
    return f"'{escaped}'"


def value_text(value: object) -> str:
    """A value as Hydra override text."""
    if isinstance(value, str):
        return value if _PLAIN.match(value) and value not in ("null", "true", "false") \
            else quote(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Sequence):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    return str(value)


def override(key: str, value: object) -> str:
    """`key=value` for Hydra."""
    return f"{key}={value_text(value)}"
