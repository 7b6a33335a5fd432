"""detect-secrets alone, as a security team would run it on these texts: all its plugins
but the two high-entropy ones and public IPs, with its value filters. The benchmark's
baseline, measured in the same run as the project's detector."""

from __future__ import annotations

import functools

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.filters import heuristic

from capibara_exp.data.e2b.scrub import formats

_LEFT_OUT = formats.LEFT_OUT - {"Secret Keyword"}
_FILTERS = (
    heuristic.is_sequential_string,
    heuristic.is_potential_uuid,
    heuristic.is_templated_secret,
    heuristic.is_prefixed_with_dollar_sign,
    heuristic.is_not_alphanumeric_string,
)


@functools.cache
def _plugins() -> tuple:
    found = get_mapping_from_secret_type_to_class()
    return tuple((formats.slug(t), found[t]()) for t in sorted(found) if t not in _LEFT_OUT)


def find(text: str) -> list[tuple[int, int, str]]:
    out, base = [], 0
    for line in text.split("\n"):
        for lo, hi, kind in formats.plugin_spans(line, _plugins()):
            if not any(f(line[lo:hi]) for f in _FILTERS):
                out.append((base + lo, base + hi, kind))
        base += len(line) + 1
    return out
