"""A run started from another model's checkpoint: T5X's RestoreCheckpointConfig with
mode='specific' and strict=False (an imported model, a pretrained run, a merge or a LoRA
export as the start of a fine-tune).

What the checkpoint has is restored and the rest starts fresh, as T5X's fallback_to_scratch
does: its parameters always (they must be exactly the model's: a missing, extra or
differently shaped one is an error naming it), its step when it has one, its optimizer state
only when it has the whole of this run's (same optimizer); otherwise the optimizer starts
from its initial state at the checkpoint's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from capibara_exp.runtime import checkpoints, integrity

_WHERE = "utils.RestoreCheckpointConfig.path"


def as_saved(state_dict: Any, target_state_dict: Any, *, is_resuming: bool = False) -> Any:
    """T5X's restore transformation that changes nothing: T5X fills what a checkpoint lacks
    (fallback_to_scratch) only when some transformation is given, so gin gives this one."""
    del target_state_dict, is_resuming
    return state_dict


def _has_optimizer_state(meta: dict, template: Any) -> bool:
    want = {tuple(str(getattr(k, "key", k)) for k in p)
            for p, _ in jax.tree_util.tree_flatten_with_path(template["state"]["param_states"])[0]}
    have = {p[2:] for p in meta if p[:2] == ("state", "param_states")}
    return bool(want) and want <= have


def restore_what_it_has(state: Any, ckpt: Path, template: Any, say: Callable[[str], None]
                        ) -> tuple[Any, int]:
    """(state, step) from checkpoint `ckpt` (see the module doc)."""
    problems = integrity.verify_checkpoint(ckpt)
    if problems:
        raise checkpoints.CheckpointError(f"{_WHERE}: {ckpt} fails verification: "
                                          f"{'; '.join(problems[:3])}")
    meta = checkpoints.tree_metadata(ckpt)
    shapes = traverse_util.flatten_dict(dict(template["target"]), sep="/")
    checkpoints.check_params(ckpt, shapes, _WHERE)
    if _has_optimizer_state(meta, template):
        tree = checkpoints.restore(ckpt.parent, int(ckpt.name.rsplit("_", 1)[1]), template)
        tree = jax.tree.map(lambda r, t: r.astype(t.dtype), tree, state.state_dict())
        restored = state.restore_state(tree)
        say(f"restored {ckpt} (parameters and optimizer state)")
        return restored, int(jax.device_get(restored.step))
    shardings = {k: v.sharding for k, v in
                 traverse_util.flatten_dict(dict(state.params), sep="/").items()}
    flat = checkpoints.restore_params(ckpt, {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                      for k, v in shapes.items()}, shardings)
    params = traverse_util.unflatten_dict(
        {k: v.astype(shapes[k].dtype) for k, v in flat.items()}, sep="/")
    step = 0
    if ("state", "step") in meta:
        step = int(checkpoints.read_leaves(ckpt, [("state", "step")])[("state", "step")])
    # The run's own state has not trained yet: its optimizer state is the initial one (the
    # optax optimizers here start from zeros of the parameters' shapes, not their values).
    restored = state.replace(params=params, step=jnp.asarray(step, state.step.dtype),
                             ema_params=None if state.ema_params is None else params)
    say(f"started from {ckpt}: its parameters (step {step}); a fresh optimizer state")
    return restored, step
