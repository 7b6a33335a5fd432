"""Where a run's weights come from, recorded in every checkpoint's manifest.

A run that starts from scratch descends from its initialisation: the seed and the
parameters' tree (names, shapes, dtypes), which together fix the initial weights. A run
that starts from another checkpoint (fine-tuning, a merge's output, a FedAvg result)
descends from that checkpoint, identified by its manifest's checksum, and from everything
that one descends from. Merging reads this to tell fine-tunes of one model, which soups
are for, from unrelated models (consensus/ancestry.py).

The lineage is a list of ancestors, nearest first, each {"id": ..., "from": words}.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax

from capibara_exp.runtime import integrity

KEY = "lineage"  # in a manifest's info


def init_ancestor(seed: int | None, params: Any) -> dict:
    """The initialisation: the seed and the parameters' tree fix the initial weights."""
    tree = sorted(("/".join(str(getattr(k, "key", k)) for k in path),
                   tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", "")))
                  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0])
    digest = hashlib.sha256(json.dumps([seed, tree]).encode()).hexdigest()[:16]
    return {"id": f"init:{digest}", "from": f"initialisation with seed {seed}"}


def of_checkpoint(step_dir: str | Path) -> list[dict] | None:
    """The lineage a checkpoint's manifest records (None: none recorded, e.g. T5X's)."""
    found = integrity.manifest_info(step_dir).get(KEY)
    return list(found) if isinstance(found, list) else None


def checkpoint_ancestor(step_dir: str | Path) -> dict | None:
    """A checkpoint as an ancestor: its manifest's checksum (None without a manifest)."""
    try:
        manifest = integrity.read_manifest(step_dir)
    except ValueError:
        return None
    if not manifest or "checksum" not in manifest:
        return None
    return {"id": f"ckpt:{manifest['checksum'][:16]}", "from": f"checkpoint {step_dir}"}


def descended_from(step_dir: str | Path) -> list[dict]:
    """The lineage of weights started from a checkpoint: it, then its own ancestors."""
    own = checkpoint_ancestor(step_dir)
    return ([own] if own else []) + (of_checkpoint(step_dir) or [])


def for_run(model_dir: str | Path, restored: Path | None, seed: int | None,
            params: Any) -> list[dict]:
    """The lineage of a run's checkpoints: its own checkpoint's when it resumed in its
    model dir, the restored checkpoint and its ancestors when it started from another,
    its initialisation when it started from scratch."""
    if restored is None:
        return [init_ancestor(seed, params)]
    if Path(restored).absolute().parent == Path(model_dir).absolute():
        return of_checkpoint(restored) or []
    return descended_from(restored)


def shared(lineages: list[list[dict]]) -> list[dict]:
    """The ancestors every lineage has, nearest first (of the first)."""
    common = set.intersection(*({a["id"] for a in lin} for lin in lineages))
    return [a for a in lineages[0] if a["id"] in common]
