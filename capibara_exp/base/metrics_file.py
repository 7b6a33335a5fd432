"""Reading metrics.jsonl so that a damaged line (cut by a crash or a full disk, binary
garbage) is counted and left out, said once, and never stops a reader (a resume, the
plot, a sweep's pruning, T5X's metrics). A leaf: only the standard library."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_records(path: str | Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and how many lines were damaged (not UTF-8, not a JSON
    object with an integer step and a split: a line cut by a crash or a full disk); those
    are left out."""
    records, damaged = [], 0
    for raw in Path(path).read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            damaged += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get("split"), str) or \
                isinstance(record.get("step"), bool) or not isinstance(record.get("step"), int):
            damaged += 1
            continue
        records.append(record)
    return records, damaged


_told: set[str] = set()


def tell_damaged(path: str | Path, damaged: int) -> None:
    """Say once per file and process how many damaged lines a reader left out."""
    if damaged and str(path) not in _told:
        _told.add(str(path))
        print(f"capibara-exp: {path}: {damaged} damaged line(s) left out", file=sys.stderr)
