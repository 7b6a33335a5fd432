"""The config Hydra composed for a command line, kept for the next command with the same one.

Hydra's composition (its defaults tree, the merges and deep copies of some 40 files, and
the scan of every plugin first) is most of what `--help`, `--cfg job` and a checked run
cost before their first line; the same command line on the same files composes the same
config, and unpickling it takes a millisecond. An entry is keyed by everything the
composition reads: the command line (config name, overrides, run or sweep), the working
directory (Hydra records it), the contents of every YAML file on the search path that Hydra
may read (the primary configs, every config group's options), the installed Hydra plugins,
the project's code that composes (resolvers, compose.py), and the versions of Python,
Hydra, OmegaConf and PyYAML. A change to any of them is another key: the next command
composes afresh. Only compositions whose values passed the checks (or that --help and
the like showed) are kept (a refused command leaves nothing); an unreadable or unwritable
cache is as if there were none. A kept composition also serves a new line that only sets
values more (compose_rest.py). CAPIBARA_COMPOSE_CACHE=0 turns it off, with the parsed
config files (parsed_cache.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pickle
import sys
from pathlib import Path

from capibara_exp.composing.resolvers import user_cache_dir

KEEP = 64  # entries kept (the newest): each is some 25 KB
_CODE = ("composing/resolvers.py", "base/private_apis.py", "cli/compose.py",
         "cli/compose_cache.py", "cli/compose_rest.py")


def enabled() -> bool:
    return os.environ.get("CAPIBARA_COMPOSE_CACHE", "1") != "0"


def key(config_name: str, overrides: list[str], dirs: list[Path], multirun: bool,
        reads: str | None = None) -> str:
    """The entry's name for a composition of these inputs (see the module's docstring);
    `reads`: what `inputs(dirs)` returned, where the caller has it."""
    digest = hashlib.sha256()
    for part in (config_name, "\0".join(overrides), str(multirun),
                 reads if reads is not None else inputs(dirs)):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\1")
    return digest.hexdigest()


def inputs(dirs: list[Path]) -> str:
    """A digest of what every composition on this search path reads besides its command
    line: the working directory, the versions, the composing code, the config files, the
    Hydra plugins (some 3 ms: one per command, however many lines it looks up)."""
    import hydra
    import omegaconf
    import yaml

    digest = hashlib.sha256()
    for part in (os.getcwd(), sys.version, hydra.__version__, omegaconf.__version__,
                 yaml.__version__, str(getattr(yaml, "__with_libyaml__", False))):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\1")
    package = Path(__file__).resolve().parents[1]
    for name in _CODE:
        _add_file(digest, package / name)
    groups = {"sweeps"} | {g for d in dirs for g in _group_paths(d)}
    for root in dirs:
        digest.update(f"root {root}\1".encode("utf-8", "surrogateescape"))
        for rel in ("", *sorted(groups)):
            for file in _yaml_files(root / rel):
                _add_file(digest, file)
    for entry in _plugins():
        digest.update(f"plugin {entry}\1".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _group_paths(root: Path, prefix: str = "") -> list[str]:
    """Every directory under root (as a relative path): the config groups and nested groups
    it can hold (a directory Hydra never reads only costs a listing)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root / prefix if prefix else root):
            if entry.is_dir() and not entry.name.startswith("."):
                rel = f"{prefix}/{entry.name}" if prefix else entry.name
                found += [rel, *_group_paths(root, rel)] if _is_conf_tree(root) else [rel]
    return found


def _is_conf_tree(root: Path) -> bool:
    # the shipped conf/ and --config-dir trees are all configs; the sweeps' root (a
    # checkout's top or the installed package) only has configs one level down
    from capibara_exp.base.paths import SWEEPS_ROOT

    return root != SWEEPS_ROOT


def _yaml_files(directory: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(directory)
                      if e.name.endswith((".yaml", ".yml")) and e.is_file())
    except OSError:
        return []


def _add_file(digest, path: Path) -> None:
    try:
        data = path.read_bytes()
    except OSError:
        data = b"\0unreadable"
    digest.update(f"{path}\1{len(data)}\1".encode("utf-8", "surrogateescape") + data)


def _plugins() -> list[str]:
    """The installed Hydra plugins (their modules register configs Hydra composes from)."""
    spec = importlib.util.find_spec("hydra_plugins")
    entries = []
    for location in (spec.submodule_search_locations or []) if spec else []:
        with contextlib.suppress(OSError):
            for entry in os.scandir(location):
                entries.append(f"{entry.path} {entry.stat().st_mtime_ns}")
    return sorted(entries)


def _path(name: str) -> Path:
    return Path(user_cache_dir("compose")) / f"{name}.pickle"


def load(name: str):
    """The composed config kept under this key, or None."""
    try:
        return pickle.loads(_path(name).read_bytes())
    except Exception:  # noqa: BLE001 - absent, unreadable or from another version: compose
        return None


def store(name: str, cfg: object) -> None:
    """Keep a composed config under its key (the newest KEEP entries stay)."""
    path = _path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_bytes(pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(partial, path)
        kept = sorted(path.parent.glob("*.pickle"), key=lambda p: p.stat().st_mtime_ns)
        for old in kept[:-KEEP]:
            old.unlink(missing_ok=True)
    except OSError:  # a read-only or full cache dir: the next command composes again
        with contextlib.suppress(OSError, UnboundLocalError):
            partial.unlink(missing_ok=True)
