"""A tree's state for "nothing was written": every file and directory under a root with its
kind, size, modification time (ns) and, for files, SHA-256. Equal snapshots before and after
a command mean it created, removed, changed and touched nothing there."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def snapshot(root: str | Path) -> dict[str, tuple]:
    root = Path(root)
    out: dict[str, tuple] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", st.st_mtime_ns, st.st_mode)
        else:
            out[rel] = ("file", st.st_size, st.st_mtime_ns, st.st_mode,
                        hashlib.sha256(path.read_bytes()).hexdigest())
    return out
