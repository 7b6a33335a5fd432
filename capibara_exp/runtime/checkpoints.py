"""Checkpoint I/O in T5X's Orbax layout: MODEL_DIR/checkpoint_<step>/state.

The tree is T5X's {'state': {'step', 'param_states'}, 'target': params}, written by an
Orbax CheckpointManager with step prefix 'checkpoint' and a PyTree handler with OCDBT,
so T5X restores it with RestoreCheckpointConfig(mode='specific') and back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

STEP_PREFIX = "checkpoint"
ITEM = "state"
_STEP_DIR_RE = re.compile(rf"^{STEP_PREFIX}_(\d+)$")


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


def save(mgr: ocp.CheckpointManager, step: int, tree: Any) -> None:
    """Write one checkpoint and wait until it is on disk."""
    mgr.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(tree)}), force=True)
    mgr.wait_until_finished()


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
