"""Checkpoint I/O in T5X's Orbax layout: MODEL_DIR/checkpoint_<step>/state.

The tree is T5X's {'state': {'step', 'param_states'}, 'target': params}, written by an
Orbax CheckpointManager with step prefix 'checkpoint' and a PyTree handler with OCDBT,
so T5X restores it with RestoreCheckpointConfig(mode='specific') and back.

Each step dir also gets a checksum manifest (MANIFEST: SHA-256 and size of every file,
written after Orbax finishes), so a merge can tell a corrupt or truncated checkpoint
from a good one before reading it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

STEP_PREFIX = "checkpoint"
ITEM = "state"
_STEP_DIR_RE = re.compile(rf"^{STEP_PREFIX}_(\d+)$")
MANIFEST = "capibara_manifest.json"
_HASH_CHUNK_BYTES = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be read."""


def manager(model_dir: str | Path, keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(step_prefix=STEP_PREFIX, max_to_keep=keep, create=True)
    return ocp.CheckpointManager(
        Path(model_dir).absolute(), options=options,
        item_handlers={ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=True)})


def steps(model_dir: str | Path) -> list[int]:
    """Finished checkpoint steps in a model dir (Orbax writes to a temporary name first)."""
    root = Path(model_dir)
    if not root.is_dir():
        return []
    found = (_STEP_DIR_RE.match(p.name) for p in root.iterdir() if (p / ITEM).is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def cast_floats(tree: Any, dtype: str) -> Any:
    """Cast floating leaves to a checkpoint dtype (T5X: SaveCheckpointConfig.dtype)."""
    target = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def save(mgr: ocp.CheckpointManager, step: int, tree: Any,
         sidecars: dict[str, dict] | None = None) -> None:
    """Write one checkpoint and wait until it is on disk. `sidecars` ({file name: JSON-able
    record}) are written into the step dir beside `state/` before the manifest, which then
    covers them (a LoRA checkpoint's pointer to its base model)."""
    mgr.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(tree)}), force=True)
    mgr.wait_until_finished()
    if jax.process_index() == 0:
        step_dir = Path(mgr.directory) / f"{STEP_PREFIX}_{step}"
        for name, record in (sidecars or {}).items():
            (step_dir / name).write_text(json.dumps(record, indent=1, sort_keys=True))
        write_manifest(step_dir)


def read_sidecar(step_dir: str | Path, name: str) -> dict | None:
    """A sidecar record that `save` wrote into a step dir, or None if there is none."""
    path = Path(step_dir) / name
    return json.loads(path.read_text()) if path.is_file() else None


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_listing(step_dir: str | Path) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} of every file under step_dir but the manifest."""
    step_dir = Path(step_dir)
    return {str(p.relative_to(step_dir)): {"sha256": _file_digest(p), "bytes": p.stat().st_size}
            for p in _files(step_dir)}


def write_manifest(step_dir: str | Path) -> Path:
    """Write step_dir/MANIFEST: {relative path: {sha256, bytes}} of every file under it."""
    step_dir = Path(step_dir)
    files = file_listing(step_dir)
    path = step_dir / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a manifest is either complete or absent
    return path


def verify_manifest(step_dir: str | Path) -> list[str] | None:
    """Problems found against step_dir's manifest ([] if intact); None if it has no manifest."""
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as err:
        return [f"{path}: unreadable manifest ({err})"]
    problems = []
    for rel, want in sorted(files.items()):
        f = step_dir / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, manifest says {want['bytes']} "
                            "(truncated or rewritten)")
        elif _file_digest(f) != want["sha256"]:
            problems.append(f"{f}: SHA-256 differs from the manifest (corrupt)")
    extra = sorted(str(p.relative_to(step_dir)) for p in _files(step_dir))
    problems += [f"{step_dir / rel}: not in the manifest" for rel in extra if rel not in files]
    return problems


def restore(model_dir: str | Path, step: int, template: Any) -> Any:
    """Read checkpoint_<step>/state into the shapes, dtypes and shardings of `template`."""
    path = Path(model_dir).absolute() / f"{STEP_PREFIX}_{step}" / ITEM
    restore_args = ocp.checkpoint_utils.construct_restore_args(template)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            return ckptr.restore(path, args=ocp.args.PyTreeRestore(item=template,
                                                                   restore_args=restore_args))
    except Exception as err:  # orbax/tensorstore raise many types for a damaged file
        raise CheckpointError(f"checkpoint {path} cannot be restored ({type(err).__name__}: "
                              f"{err}); move it aside to resume from an earlier step") from err
