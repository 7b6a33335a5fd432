"""Verified restore: pick the newest checkpoint that verifies, fall back past the ones that
do not (moving them aside), and repair the manifest of one whose save was cut off between
Orbax's commit and the manifest.

A checkpoint verifies when Orbax's commit marker is there and its manifest matches every
file. One without a manifest (the kill fell between the commit and the manifest, or T5X
wrote it) is restored, checked against the model's tree and for NaN/Inf, and given a
manifest marked as repaired. Process 0 decides and moves; every process restores the step
it broadcasts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from capibara_exp.base import phases
from capibara_exp.base.errors import ConfigError, RunError, environment_failure
from capibara_exp.runtime import checkpoints, integrity


class NoVerifiedCheckpoint(RunError):
    """Checkpoints exist but none verifies."""


def _agree(step: int) -> int:
    """Process 0's choice, on every process."""
    if jax.process_count() == 1:
        return step
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(step)))


def _tree_mismatch(step_path: Path, template: Any) -> str | None:
    """How a checkpoint's tree differs from the model's (another model wrote it), or None."""
    want = {tuple(str(getattr(k, "key", k)) for k in path): tuple(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]}
    have = {p: tuple(m.shape) for p, m in checkpoints.tree_metadata(step_path).items()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        return ("leaves " + ", ".join("/".join(p) for p in (missing or extra)[:2])
                + (" missing" if missing else " not in this model"))
    for path, shape in want.items():
        if have[path] != shape:
            return f"{'/'.join(path)} has shape {have[path]}, this model's is {shape}"
    return None


def _check_tree(path: Path, template: Any) -> str | None:
    """ConfigError when another model wrote the checkpoint; why it is unreadable, or None."""
    try:
        mismatch = _tree_mismatch(path, template)
    except Exception as err:  # orbax raises many types for unreadable metadata: damaged
        if environment_failure(err):  # too many open files, no memory: the checkpoint is
            raise  # not damaged, and is not set aside
        return f"unreadable metadata ({type(err).__name__}: {str(err)[:200]})"
    if mismatch:
        raise ConfigError(f"{path} was written by another model ({mismatch}): resume it with "
                          "the model that wrote it, or use a new model_dir")
    return None


def _restore_unverified(model_dir: str, step: int, template: Any) -> tuple[Any, str | None]:
    """(tree, None) for a manifest-less checkpoint that reads whole and finite, whose
    manifest is then repaired; (None, why not) otherwise."""
    path = checkpoints.step_dir(model_dir, step)
    try:
        tree = checkpoints.restore(model_dir, step, template)
    except checkpoints.CheckpointError as err:
        return None, str(err.__cause__ or err)[:300]
    if not checkpoints.all_finite(tree):
        return None, f"holds NaN/Inf (in {', '.join(checkpoints.nonfinite_paths(tree))})"
    if jax.process_index() == 0:
        integrity.write_manifest(path, step=step, kind=_orbax_kind(path), finite=True, repaired={
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "why": "no manifest: the save was cut off after Orbax's commit (or another tool "
                   "wrote it); rebuilt from the files after a full read, tree and finiteness "
                   "check against Orbax's metadata"})
    return tree, None


def _orbax_kind(path: Path) -> str:
    import json

    try:
        meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
        return str((meta.get("custom_metadata") or {}).get(checkpoints.KIND_KEY, "unknown"))
    except (OSError, ValueError):
        return "unknown"


VERIFIED, NO_MANIFEST, FAILED = 0, 1, 2


def _status(path: Path, template: Any) -> tuple[int, list[str]]:
    """(VERIFIED | NO_MANIFEST | FAILED, problems) of a step dir, as process 0 finds it."""
    if jax.process_index() != 0:
        return VERIFIED, []
    problems = integrity.verify_checkpoint(path)
    if problems:
        return FAILED, problems
    unreadable = _check_tree(path, template)
    if unreadable:
        return FAILED, [unreadable]
    return (NO_MANIFEST, []) if problems is None else (VERIFIED, [])


def restore_verified(model_dir: str, template: Any, say: Callable[[str], None],
                     quarantine: bool = True) -> tuple[int, Any] | None:
    """(step, tree) of the newest checkpoint of model_dir that verifies, or None when there
    is none at all. Failing newer ones are moved to model_dir/corrupt/ (quarantine) and said
    in one line each; NoVerifiedCheckpoint when checkpoints exist and none verifies."""
    failed: list[tuple[int, list[str]]] = []
    for step in reversed(checkpoints.steps(model_dir)):
        path = checkpoints.step_dir(model_dir, step)
        status, problems = _status(path, template)
        status = _agree(status)
        if status == FAILED:
            failed.append((step, problems or ["failed verification on process 0"]))
            continue
        if status == NO_MANIFEST:
            tree, why = _restore_unverified(model_dir, step, template)
            if tree is None:
                failed.append((step, [why]))
                continue
            say(f"checkpoint_{step} had no manifest (cut off after Orbax's commit): read whole "
                "and finite, manifest repaired")
        else:
            tree = checkpoints.restore(model_dir, step, template)
        _set_aside(model_dir, failed, step, say, quarantine)
        return step, tree
    if failed:
        raise NoVerifiedCheckpoint(
            f"no checkpoint in {model_dir} verifies, so none is restored: " + "; ".join(
                f"checkpoint_{s}: {' / '.join(p[:2])}" for s, p in failed)
            + ". Move them away (or use a new model_dir) to start from scratch")
    return None


def _set_aside(model_dir: str, failed: list, restored: int, say: Callable[[str], None],
               quarantine: bool) -> None:
    for step, problems in failed:
        where = "kept in place (not this run's model dir)"
        if quarantine and jax.process_index() == 0:
            dest = integrity.move_aside(model_dir, checkpoints.step_dir(model_dir, step),
                                        problems)
            where = f"moved to {dest}"
        say(f"checkpoint_{step} failed verification ({problems[0]}); {where}; falling back to "
            f"checkpoint_{restored}")
    if failed and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("capibara_exp: corrupt checkpoints moved aside")


def is_step_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path.name.startswith(f"{checkpoints.STEP_PREFIX}_")
            and (path / checkpoints.ITEM).is_dir())


def restore_specific(ckpt: Path, template: Any) -> tuple[int, Any]:
    """mode 'specific': that checkpoint, which must verify (no fallback: it was asked for)."""
    problems = integrity.verify_checkpoint(ckpt)
    if problems:
        raise checkpoints.CheckpointError(f"utils.RestoreCheckpointConfig.path: {ckpt} fails "
                                          f"verification: {'; '.join(problems[:3])}")
    step = int(ckpt.name.split("_")[-1])
    return step, checkpoints.restore(ckpt.parent, step, template)


def newest_finite(model_dir: str) -> str:
    """The newest checkpoint of model_dir that exists and was checked finite, in words."""
    found = checkpoints.steps(model_dir)
    for step in reversed(found):
        if integrity.manifest_info(checkpoints.step_dir(model_dir, step)).get("finite"):
            return (f"the newest finite checkpoint is {model_dir}/checkpoint_{step} "
                    "(re-running resumes from it)")
    if found:
        return (f"no checkpoint in {model_dir} is known to be finite (checkpoint_{found[-1]} "
                "and older were written without the check)")
    return f"no checkpoint exists in {model_dir}: a re-run starts from scratch"


def restore(state: Any, cfg: Any, model_dir: str, say: Callable[[str], None],
            on_restore: Callable[[Path], None] | None = None) -> tuple[Any, int]:
    """train's restore phase, in T5X's order: the newest checkpoint of the run's own
    model_dir that verifies (corrupt ones moved aside); else what `cfg` (T5X's
    RestoreCheckpointConfig, None for none) names: a specific checkpoint (an initial
    checkpoint: strict=False restores what it has, parameters at least) or the latest of
    another directory; else a start from scratch. Returns the state and its step, which is
    also the data position. `on_restore` is told the step dir restored (the run's lineage
    starts there)."""
    if checkpoints.steps(model_dir):
        return _restored(state, model_dir, "latest", cfg, say, own=True, on_restore=on_restore)
    for path in (cfg.paths if cfg is not None else []):
        if not path:
            continue
        if cfg.mode == "latest" and not Path(path).is_dir():  # as in T5X
            raise ValueError(f"utils.RestoreCheckpointConfig.path: {path} is not a directory "
                             "(mode 'latest' looks for checkpoint_<step> in one)")
        if cfg.mode == "specific" and not is_step_dir(path):
            raise FileNotFoundError(f"utils.RestoreCheckpointConfig.path: no checkpoint at "
                                    f"{path} (a checkpoint_<step> dir with {checkpoints.ITEM}/)")
        if cfg.mode == "specific" or checkpoints.steps(path):
            return _restored(state, path, cfg.mode, cfg, say, own=False, on_restore=on_restore)
    return state, 0  # as in T5X: nothing to restore is a start from scratch


def _restored(state: Any, path: str, mode: str, cfg: Any, say: Callable[[str], None],
              own: bool, on_restore: Callable[[Path], None] | None) -> tuple[Any, int]:
    template = state.state_dict()
    if cfg is not None and cfg.dtype:
        template = checkpoints.cast_floats(template, cfg.dtype)
    with phases.phase(f"restoring a checkpoint of {path}"):
        if mode == "specific" and cfg is not None and not cfg.strict:
            from capibara_exp.runtime import initial

            restored, step = initial.restore_what_it_has(state, Path(path), template, say)
            if on_restore is not None:
                on_restore(Path(path).absolute())
            return restored, step
        found = (restore_verified(str(path), template, say, own) if mode == "latest"
                 else restore_specific(Path(path), template))
    step, tree = found
    tree = jax.tree.map(lambda r, t: r.astype(t.dtype), tree, state.state_dict())
    kind = integrity.manifest_info(Path(path) / f"checkpoint_{step}").get("kind")
    where = f"{path}/checkpoint_{step}" if mode == "latest" else str(path)
    say(f"restored {where}" + (f" (a {kind} save)" if kind == "preemption" else ""))
    restored = state.restore_state(tree)
    if on_restore is not None:
        on_restore(Path(path).absolute() / f"checkpoint_{step}" if mode == "latest" else
                   Path(path).absolute())
    return restored, int(jax.device_get(restored.step))
