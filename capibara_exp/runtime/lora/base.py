"""The base checkpoint of a LoRA run: where it is, that it is intact and fits the model, and
the pointer to it that every LoRA checkpoint carries.

The pointer (`checkpoint_<step>/lora_base.json`, covered by the step's checksum manifest)
names the base checkpoint and the SHA-256 of its checksum manifest (the digest and size of
every file of the base), plus how the base was quantized: a resume and an export check
that the base they read is the one the adapters were trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capibara_exp.base.errors import ConfigError
from capibara_exp.runtime import checkpoints, integrity

POINTER = checkpoints.LORA_POINTER
# What makes adapters fit a base: its contents and how they were quantized (not its path).
_IDENTITY = ("manifest_sha256", "quantize_base", "quantize_block_size")
_WHERE = "lora.LoraModel.base_checkpoint"


def resolve(path: str | Path) -> Path:
    """A checkpoint_<step> dir as given, or a model dir's latest one."""
    root = Path(path).expanduser().absolute()
    if root.name.startswith(checkpoints.STEP_PREFIX + "_"):
        if not (root / checkpoints.ITEM).is_dir():
            raise ConfigError(f"{_WHERE}={path}: {root / checkpoints.ITEM} does not exist")
        return root
    found = checkpoints.steps(root)
    if not found:
        raise ConfigError(f"{_WHERE}={path}: no checkpoint_<step>/{checkpoints.ITEM} in {root} "
                          "(give a run's model dir or one of its checkpoint_<step> dirs)")
    return root / f"{checkpoints.STEP_PREFIX}_{found[-1]}"


def manifest_digest(step_dir: Path) -> str:
    """SHA-256 of a checkpoint's checksum manifest (its files' digests and sizes), checked
    against the files first. A checkpoint without a manifest (T5X writes none) gets its
    listing computed here, so the digest names the same contents either way."""
    problems = integrity.verify_manifest(step_dir)
    if problems:
        raise ConfigError(f"{_WHERE}: {step_dir} is damaged ({len(problems)} problem(s)): "
                          f"{problems[0]}")
    if problems is None:
        files = integrity.file_listing(step_dir)
    else:
        files = integrity.read_manifest(step_dir)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def pointer(step_dir: Path, quantize_base: str, block_size: int | None) -> dict[str, Any]:
    """The record a LoRA checkpoint keeps of its base (reads and checks every base file)."""
    return {"base_checkpoint": str(step_dir), "manifest": integrity.MANIFEST,
            "manifest_sha256": manifest_digest(step_dir), "quantize_base": quantize_base,
            "quantize_block_size": block_size}


def check_same_base(recorded: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Adapters trained on `recorded`'s base must not continue on another one."""
    for key in _IDENTITY:
        if recorded.get(key) != current.get(key):
            raise ConfigError(
                f"{_WHERE}: {where} was trained on {recorded.get('base_checkpoint')} "
                f"({key}={recorded.get(key)!r}), but this run reads {current['base_checkpoint']} "
                f"({key}={current.get(key)!r}); give the original base (and lora settings) or "
                "start in a new model_dir")


def read_pointer(step_dir: Path) -> dict[str, Any]:
    record = checkpoints.read_sidecar(step_dir, POINTER)
    if record is None:
        raise ConfigError(f"{step_dir} has no {POINTER}: not a checkpoint of a LoRA run")
    return record


def check_shapes(step_dir: Path, expected: Mapping[str, Any], where: str = _WHERE) -> None:
    """The base's params must be the model's (runtime/checkpoints.check_params)."""
    checkpoints.check_params(step_dir, expected, where)


restore_params = checkpoints.restore_params
