"""Whole files or none: every file the project writes for a reader to find (a corpus, a
manifest, a sweep's results, generations) is written to a temporary name beside its final
one and renamed over it, so a killed or crashed writer never leaves half a file.

The temporary name is hidden, unique to the host, process and thread (several machines
may write one file in a shared sweep dir; a checksum action and the saver's callback may
write one manifest at once), and keeps the final suffix (matplotlib picks a format by it).
A failed write removes it. The last writer wins.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """Where a write of `path` goes before the rename (same directory, same file system)."""
    unique = f"{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    return path.with_name(f".{path.stem}.{unique}.tmp{path.suffix}")


def write_with(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)`, then rename tmp over `path`; tmp is gone whatever happens."""
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:  # a full disk or a size limit: no temporary file left behind
        tmp.unlink(missing_ok=True)
    return path


def write_bytes(path: Path, payload: bytes) -> Path:
    return write_with(path, lambda tmp: tmp.write_bytes(payload))


def write_text(path: Path, text: str) -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_lines(path: Path, lines: Iterable[str]) -> Path:
    """One line per item, each ending in a newline (items are written as they come)."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")

    return write_with(path, write)
