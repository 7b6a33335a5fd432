"""Writing a sweep's files where several machines may write them at once (a shared sweep
dir): whole or not at all, so that a reader never sees half a file."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path


def write_with(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` to a temporary name beside `path`, then rename it over `path` (atomic on
    one file system; the last writer wins, and every writer writes the same study)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{socket.gethostname()}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text))
