"""Checkpoint integrity without training: manifests (their own checksum, Orbax's commit
marker, older SHA-256 ones), saves that refuse NaN, asynchronous saves, verified restore
with fallback, quarantine and repair, on small trees written by the real Checkpointer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from capibara_exp.base.errors import ConfigError
from capibara_exp.runtime import checkpoints, integrity, resume


def tree(value: float) -> dict:
    return {"state": {"step": jnp.asarray(int(value), jnp.int32)},
            "target": {"w": jnp.full((64, 32), value, jnp.float32),
                       "b": jnp.arange(8, dtype=jnp.float32) * value}}


def write(model_dir: Path, steps: list[int], async_save: bool = False) -> None:
    saver = checkpoints.manager(model_dir, async_save=async_save)
    for step in steps:
        saver.save(step, tree(float(step)), kind="periodic", wait=not async_save)
    saver.close()


def flip(path: Path, at: int | None = None, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_manifest_covers_every_file_and_itself(tmp_path) -> None:
    write(tmp_path, [1])
    step_dir = checkpoints.step_dir(tmp_path, 1)
    manifest = json.loads((step_dir / integrity.MANIFEST).read_text())
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
               if p.is_file() and p.name != integrity.MANIFEST}
    assert set(manifest["files"]) == on_disk and integrity.COMMIT_MARKER in on_disk
    assert manifest["algorithm"] == "blake3"
    assert manifest["info"] == {"step": 1, "kind": "periodic", "finite": True}
    assert integrity.verify_checkpoint(step_dir) == []
    # A flipped bit anywhere in the manifest is caught, whether or not its JSON still parses.
    text = (step_dir / integrity.MANIFEST).read_text()
    digit = text.index('"digest": "') + len('"digest": "') + 3
    for at in (digit, text.index('"kind"') + 3, 0):
        flip(step_dir / integrity.MANIFEST, at)
        problems = integrity.verify_checkpoint(step_dir)
        assert problems and "manifest" in problems[0], (at, problems)
        (step_dir / integrity.MANIFEST).write_text(text)
    assert integrity.verify_checkpoint(step_dir) == []


def test_a_deleted_commit_marker_and_a_sha256_manifest(tmp_path) -> None:
    write(tmp_path, [1, 2])
    marker = checkpoints.step_dir(tmp_path, 2) / integrity.COMMIT_MARKER
    marker.unlink()
    problems = integrity.verify_checkpoint(marker.parent)
    assert problems[0].endswith("Orbax's commit marker is missing (the save never finished, "
                                "or the file was deleted)")
    # A manifest an earlier version wrote (SHA-256, no checksum of itself) still verifies.
    old = checkpoints.step_dir(tmp_path, 1)
    files = {str(p.relative_to(old)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                       "bytes": p.stat().st_size}
             for p in sorted(old.rglob("*")) if p.is_file() and p.name != integrity.MANIFEST}
    (old / integrity.MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": files}))
    assert integrity.verify_checkpoint(old) == []
    flip(next(old.rglob("_METADATA")))
    assert "SHA-256 digest differs from the manifest" in integrity.verify_checkpoint(old)[0]


def test_a_save_refuses_nan_and_async_saves_get_manifests(tmp_path) -> None:
    saver = checkpoints.manager(tmp_path, async_save=True)
    bad = tree(1.0)
    bad["target"]["b"] = bad["target"]["b"].at[3].set(jnp.inf)
    with pytest.raises(checkpoints.NonFiniteState, match=r"checkpoint_5 not written: the state "
                                                         r"holds NaN/Inf \(in target/b\)"):
        saver.save(5, bad, kind="periodic", wait=False)
    for step in (1, 2, 3):
        saver.save(step, tree(float(step)), kind="periodic", wait=False)
    saver.close()
    assert checkpoints.steps(tmp_path) == [1, 2, 3]
    assert all(integrity.verify_checkpoint(checkpoints.step_dir(tmp_path, s)) == []
               for s in (1, 2, 3))
    host = {"target": {"w": np.array([np.nan], np.float32)}}  # host arrays: checked too
    assert not checkpoints.all_finite(host) and checkpoints.all_finite(tree(2.0))


def test_restore_falls_back_past_corrupt_ones_and_moves_them_aside(tmp_path) -> None:
    write(tmp_path, [1, 2, 3], async_save=True)
    flip(max((p for p in (checkpoints.step_dir(tmp_path, 3) / "state").rglob("*")
              if p.is_file()), key=lambda p: p.stat().st_size))
    (checkpoints.step_dir(tmp_path, 2) / integrity.COMMIT_MARKER).unlink()
    said: list[str] = []
    step, restored = resume.restore_verified(str(tmp_path), tree(0.0), said.append)
    assert step == 1 and float(restored["target"]["w"][0, 0]) == 1.0
    assert checkpoints.steps(tmp_path) == [1]
    assert [s.split(" failed verification")[0] for s in said] == ["checkpoint_3", "checkpoint_2"]
    assert all(s.endswith("falling back to checkpoint_1") and "moved to " in s for s in said)
    assert "\n" not in "".join(said)
    reason = (tmp_path / "corrupt" / "checkpoint_3" / integrity.REASON_FILE).read_text()
    assert "BLAKE3 digest differs from the manifest (corrupt)" in reason
    assert (tmp_path / "corrupt" / "checkpoint_2" / integrity.REASON_FILE).is_file()
    assert "falling back" not in resume.newest_finite(str(tmp_path))
    assert resume.newest_finite(str(tmp_path)).startswith("the newest finite checkpoint is ")


def test_none_verifying_is_an_error_and_a_missing_manifest_is_repaired(tmp_path) -> None:
    write(tmp_path, [1, 2])
    for step in (1, 2):
        flip(checkpoints.step_dir(tmp_path, step) / "_CHECKPOINT_METADATA")
    with pytest.raises(resume.NoVerifiedCheckpoint, match=r"checkpoint_2: .*_CHECKPOINT_METADATA"
                                                          r".*; checkpoint_1: "):
        resume.restore_verified(str(tmp_path), tree(0.0), print)
    assert checkpoints.steps(tmp_path) == [1, 2]  # nothing to fall back to: nothing moved
    other = tmp_path / "cut"
    write(other, [4])
    (checkpoints.step_dir(other, 4) / integrity.MANIFEST).unlink()  # killed before it
    said: list[str] = []
    step, restored = resume.restore_verified(str(other), tree(0.0), said.append)
    assert step == 4 and float(restored["target"]["b"][1]) == 4.0
    assert "manifest repaired" in said[0]
    info = integrity.manifest_info(checkpoints.step_dir(other, 4))
    assert info["repaired"]["why"].startswith("no manifest") and info["kind"] == "periodic"
    assert integrity.verify_checkpoint(checkpoints.step_dir(other, 4)) == []
    odd = {"state": {"step": jnp.asarray(0)}, "target": {"w": jnp.zeros((64, 16)),
                                                         "b": jnp.zeros(8)}}
    with pytest.raises(ConfigError, match=r"written by another model \(target/w has shape "
                                          r"\(64, 32\), this model's is \(64, 16\)\)"):
        resume.restore_verified(str(other), odd, print)
