"""Config files as OmegaConf read them, kept by their contents for the next composition.

Hydra reads each file a composition uses with OmegaConf.load: YAML parsed, then every value
wrapped in OmegaConf's nodes, some 1 ms a file, 40 files for the default config. The same
bytes give the same config, and unpickling it takes a twentieth of that. While `reused()`
runs (the project's own compositions: cli/compose.py), OmegaConf.load returns the config
kept for the bytes it is given, or reads them as always and keeps the result. An entry is
keyed by the file's bytes and by what turns them into a config: the versions of Python,
OmegaConf and PyYAML, libyaml's presence and the loader capibara-exp gives OmegaConf
(base/private_apis.py). An edited file is new bytes: read afresh, and only it. A file that does
not load (malformed YAML, a bad interpolation) is never kept: it fails as it always does.
What a command read is written only once its composition passed its checks (`keep`, from
compose.keep): a refused command leaves nothing. CAPIBARA_COMPOSE_CACHE=0 turns it off with
the kept compositions (compose_cache.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

from capibara_exp.cli import compose_cache
from capibara_exp.composing.resolvers import user_cache_dir

KEEP = 512  # entries kept (the newest): each is a few KB
_read_here: dict[str, bytes] = {}  # what this process read afresh, for `keep`


@contextlib.contextmanager
def reused() -> Iterator[None]:
    """While the block runs, OmegaConf.load of an open file reuses the config kept for its
    bytes (see the module's docstring)."""
    if not compose_cache.enabled():
        yield
        return
    from omegaconf import OmegaConf

    saved = OmegaConf.__dict__["load"]  # the staticmethod itself, put back as it was
    real = saved.__func__
    entries = {**_read(), **_read_here}

    def load(file_):
        if not hasattr(file_, "read") or not hasattr(file_, "seek"):
            return real(file_)  # a path: OmegaConf opens it; not a composition's read
        data = file_.read()
        name = _name(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
        kept = entries.get(name)
        if kept is not None:
            with contextlib.suppress(Exception):  # an entry of another make: read afresh
                return pickle.loads(kept)
        file_.seek(0)  # PyYAML's marks name the file it reads: give it the file
        cfg = real(file_)
        entries[name] = _read_here[name] = pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL)
        return cfg

    OmegaConf.load = staticmethod(load)
    try:
        yield
    finally:
        OmegaConf.load = saved


def keep() -> None:
    """Write what this process read afresh (its command passed its checks)."""
    if _read_here:
        _write({**_read(), **_read_here})
        _read_here.clear()


def _name(data: bytes) -> str:
    return hashlib.sha256(_maker() + data).hexdigest()


@functools.cache
def _maker() -> bytes:
    """What turns a file's bytes into its config, besides the bytes."""
    import omegaconf
    import yaml

    loader = Path(__file__).resolve().parents[1] / "base" / "private_apis.py"
    parts = (sys.version, omegaconf.__version__, yaml.__version__,
             str(getattr(yaml, "__with_libyaml__", False)),
             hashlib.sha256(loader.read_bytes()).hexdigest())
    return "\1".join(parts).encode() + b"\0"


def _path() -> Path:
    return Path(user_cache_dir("parsed")) / "configs.pickle"


def _read() -> dict[str, bytes]:
    try:
        entries = pickle.loads(_path().read_bytes())
    except Exception:  # noqa: BLE001 - absent, unreadable or another version's: start anew
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(entries: dict[str, bytes]) -> None:
    """Keep the newest KEEP entries; an unwritable cache dir only means reading again."""
    path = _path()
    newest = dict(list(entries.items())[-KEEP:])
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(pickle.dumps(newest, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
