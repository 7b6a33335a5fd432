"""Checkpoint I/O in T5X's Orbax layout: MODEL_DIR/checkpoint_<step>/state.

The tree is T5X's {'state': {'step', 'param_states'}, 'target': params}, written by an
Orbax CheckpointManager with step prefix 'checkpoint' and a PyTree handler with OCDBT,
so T5X restores it with RestoreCheckpointConfig(mode='specific') and back.

Every save first checks that the state is finite (one fused reduction on the devices) and
refuses a state with NaN/Inf. Saves may be asynchronous (Orbax copies the arrays off the
devices, then writes while training goes on); when Orbax has committed a step, its
post-finalization callback writes the step's checksum manifest (runtime/integrity.py).
The kind of save (periodic, preemption, ...) goes into Orbax's own step metadata too.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from capibara_exp.base.errors import ConfigError, RunError
from capibara_exp.runtime import integrity

STEP_PREFIX = "checkpoint"
ITEM = "state"
_STEP_DIR_RE = re.compile(rf"^{STEP_PREFIX}_(\d+)$")
KIND_KEY = "capibara_save_kind"  # in Orbax's custom step metadata
# A LoRA run's sidecar in each of its checkpoints (runtime/lora/base.py): its base model.
LORA_POINTER = "lora_base.json"


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be read."""


class NonFiniteState(RunError):
    """A save was refused: the state holds NaN or Inf."""


def step_dir(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir).absolute() / f"{STEP_PREFIX}_{step}"


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


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", np.asarray(x).dtype), jnp.inexact)


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def all_finite(tree: Any) -> bool:
    """Whether every float leaf is finite: one fused reduction on the devices for jax.Arrays
    (one scalar comes back), NumPy on the host for host arrays."""
    leaves = [x for x in jax.tree.leaves(tree) if _is_float(x)]
    on_device = [x for x in leaves if isinstance(x, jax.Array)]
    on_host = [x for x in leaves if not isinstance(x, jax.Array)]
    if on_device and not bool(_all_finite(on_device)):
        return False
    return all(bool(np.isfinite(x).all()) for x in on_host)


def nonfinite_paths(tree: Any, limit: int = 3) -> list[str]:
    """Paths of (up to `limit`) leaves holding NaN/Inf: the slow look, for messages."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_float(leaf) and not bool(np.isfinite(np.asarray(leaf)).all()):
            found.append("/".join(str(getattr(k, "key", k)) for k in path))
            if len(found) == limit:
                break
    return found


class Checkpointer:
    """An Orbax CheckpointManager for one model dir that writes manifests and refuses
    non-finite states. `async_save`: saves return once the arrays are off the devices."""

    def __init__(self, model_dir: str | Path, keep: int | None = None,
                 async_save: bool = False):
        self.directory = Path(model_dir).absolute()
        self._pending: dict[int, dict] = {}  # committed-to-be steps -> manifest facts
        self._sidecars: dict[int, dict[str, dict]] = {}  # their extra files
        self._lock = threading.Lock()
        self.lineage: list[dict] | None = None  # runtime/lineage.py: recorded in manifests
        self.committed: list[tuple[int, str]] = []  # (step, step dir) with their manifests
        options = ocp.CheckpointManagerOptions(
            step_prefix=STEP_PREFIX, max_to_keep=keep, create=True,
            cleanup_tmp_directories=True,  # a save a kill cut short leaves a temporary dir
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifests)
            if async_save else None)
        self._mgr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=True)})

    def save(self, step: int, tree: Any, kind: str = "saved", wait: bool = True,
             sidecars: dict[str, dict] | None = None) -> Path:
        """Write checkpoint_<step> (refusing a non-finite tree); with wait=False return once
        Orbax has the arrays, and the manifest follows when the step is committed.
        `sidecars` ({file name: JSON-able record}) go into the step dir once it is committed,
        before its manifest, which then covers them (a LoRA run's pointer to its base)."""
        if not all_finite(tree):
            where = ", ".join(nonfinite_paths(tree))
            raise NonFiniteState(f"checkpoint_{step} not written: the state holds NaN/Inf "
                                 f"(in {where})")
        self.wait()  # one save at a time: the previous one commits before this one starts
        with self._lock:
            self._pending[step] = {"step": step, "kind": kind, "finite": True}
            if self.lineage is not None:
                self._pending[step]["lineage"] = self.lineage
            self._sidecars[step] = dict(sidecars or {})
        self._mgr.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(tree)}),
                       force=True, custom_metadata={KIND_KEY: kind})
        if wait or not self._mgr.is_saving_in_progress():
            self.wait()
        return step_dir(self.directory, step)

    def _write_manifests(self) -> None:
        """Orbax's post-finalization callback: manifests for the steps it has committed."""
        with self._lock:
            pending = dict(self._pending)
        for step, info in sorted(pending.items()):
            path = step_dir(self.directory, step)
            if not (path / integrity.COMMIT_MARKER).is_file():
                continue
            if jax.process_index() == 0:
                for name, record in self._sidecars.get(step, {}).items():
                    (path / name).write_text(json.dumps(record, indent=1, sort_keys=True))
                integrity.write_manifest(path, **info)
            with self._lock:
                self.committed.append((step, str(path)))
                self._pending.pop(step, None)
                self._sidecars.pop(step, None)

    def wait(self) -> None:
        """Until every save has been committed and has its manifest."""
        self._mgr.wait_until_finished()
        if self._pending:  # a synchronous save runs no async callback
            self._write_manifests()

    def close(self) -> None:
        """Wait for the saves, then stop Orbax's threads, also when a save failed (a full
        disk): nothing of this manager writes after close returns, so a failed command's
        cleanup removes what it began for good."""
        try:
            self.wait()
        finally:
            self._mgr.close()


def manager(model_dir: str | Path, keep: int | None = None,
            async_save: bool = False) -> Checkpointer:
    return Checkpointer(model_dir, keep, async_save)


def save(mgr: Checkpointer, step: int, tree: Any, kind: str = "saved",
         sidecars: dict[str, dict] | None = None, lineage: list[dict] | None = None) -> Path:
    """Write one checkpoint and wait until it is on disk with its manifest (recording
    `lineage`, runtime/lineage.py, when given)."""
    if lineage is not None:
        mgr.lineage = lineage
    return mgr.save(step, tree, kind, wait=True, sidecars=sidecars)


def read_sidecar(step_path: str | Path, name: str) -> dict | None:
    """A sidecar record that a save wrote into a step dir, or None if there is none."""
    path = Path(step_path) / name
    return json.loads(path.read_text()) if path.is_file() else None


def tree_metadata(step_path: str | Path) -> dict[tuple[str, ...], Any]:
    """{leaf path: Orbax's metadata of the leaf (shape, dtype, sharding)} of a step dir."""
    # The item's handler reads its tree metadata (the Checkpointer would also look for
    # step metadata inside the item dir, and warn that it is not there).
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(Path(step_path) / ITEM)
    finally:
        handler.close()
    tree = getattr(meta, "tree", meta)
    return {tuple(str(k.key) for k in path): m
            for path, m in jax.tree_util.tree_flatten_with_path(tree)[0]}


def restore(model_dir: str | Path, step: int, template: Any) -> Any:
    """Read checkpoint_<step>/state into the shapes, dtypes and shardings of `template`."""
    path = step_dir(model_dir, step) / ITEM
    restore_args = ocp.checkpoint_utils.construct_restore_args(template)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            return ckptr.restore(path, args=ocp.args.PyTreeRestore(item=template,
                                                                   restore_args=restore_args))
    except Exception as err:  # orbax/tensorstore raise many types for a damaged file
        raise CheckpointError(f"checkpoint {path} cannot be restored ({type(err).__name__}: "
                              f"{err}); move it aside to resume from an earlier step") from err


# Exponent bits of the IEEE float formats (bfloat16 included): all ones is Inf or NaN.
_EXPONENTS = {2: (np.uint16, 0x7F80), 4: (np.uint32, 0x7F800000),
              8: (np.uint64, 0x7FF0000000000000)}


def finite_bits(array: np.ndarray) -> bool:
    """Whether a host array holds no NaN/Inf, read from its bits (20x faster than through
    float32 for bfloat16); non-float arrays are finite."""
    if not _is_float(array):
        return True
    if array.dtype == np.float16:
        uint, mask = np.uint16, 0x7C00
    else:
        uint, mask = _EXPONENTS[array.dtype.itemsize]
    bits = array.reshape(-1).view(uint)
    return not np.any((bits & uint(mask)) == uint(mask))


def read_leaves(step_path: str | Path, paths: list[tuple[str, ...]]) -> dict[tuple, np.ndarray]:
    """Some leaves of a checkpoint (paths into its tree, e.g. ('target', 'layers_0', ...)),
    as host arrays in their stored dtypes; nothing else is read."""
    meta = tree_metadata(step_path)
    item: dict = {}
    for path in paths:
        if path not in meta:
            raise CheckpointError(f"{step_path}: has no leaf {'/'.join(path)}")
        node = item
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=meta[path].dtype)
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(Path(step_path) / ITEM, args=ocp.args.PyTreeRestore(
            item=jax.tree.map(lambda _: 0, item), restore_args=item, partial_restore=True))
    flat = {tuple(str(k.key) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return {path: flat[path] for path in paths}


def check_params(step_dir: Path, expected: Mapping[str, Any], where: str) -> None:
    """The checkpoint's params ('target') must be the model's: an error naming the first
    parameter (in path order) that is missing, extra or of another shape. `where`: the
    setting that named the checkpoint, for the message."""
    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(step_dir / ITEM).tree
    except Exception as err:  # orbax raises many types for an unreadable checkpoint
        raise ConfigError(f"{where}: cannot read {step_dir}: {type(err).__name__}: {err}") from err
    if "target" not in tree:
        raise ConfigError(f"{where}: {step_dir} is not in T5X's layout (no 'target' params)")
    stored = {k: tuple(v.shape) for k, v in
              traverse_util.flatten_dict(dict(tree["target"]), sep="/").items()}
    want = {k: tuple(v.shape) for k, v in expected.items()}
    problems = [(k, f"checkpoint {stored.get(k, 'has none')}, model {want[k]}")
                for k in sorted(want) if stored.get(k) != want[k]]
    problems += [(k, f"checkpoint {stored[k]}, not in the model") for k in sorted(stored)
                 if k not in want]
    if problems:
        first, detail = problems[0]
        raise ConfigError(f"{where}: {step_dir} does not fit the model ({len(problems)} of "
                          f"{len(want)} parameters differ); first: {first}: {detail}")


def restore_params(step_dir: Path, shapes: Mapping[str, Any],
                   shardings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's params (flat), in the dtypes of `shapes`: placed on `shardings`, or
    as host arrays without them. Only 'target' is read, not the optimizer state."""
    flat = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=None if shardings is None else shardings[k])
            for k, v in shapes.items()}
    item = {"target": traverse_util.unflatten_dict(flat, sep="/")}
    if shardings is None:
        args = jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype), item)
    else:
        args = ocp.checkpoint_utils.construct_restore_args(item)
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(step_dir / ITEM, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
    return traverse_util.flatten_dict(tree["target"], sep="/")
