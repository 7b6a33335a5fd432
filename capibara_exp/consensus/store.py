"""Candidate checkpoints read one leaf at a time (Orbax partial restore), merged ones written.

A merge never holds every candidate in memory: it walks the leaves of the tree (names,
shapes and partition specs from Orbax's metadata) and, for each, reads that leaf of each
candidate from the OCDBT store with TensorStore: into host memory, or, given a device
mesh, placed with the sharding it was saved with.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from capibara_exp.runtime import checkpoints

LeafPath = tuple[str, ...]
TARGET, EMA_TARGET = "target", "ema_target"


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """Shape, dtype and saved partition spec of one leaf."""

    shape: tuple[int, ...]
    dtype: np.dtype
    spec: tuple | None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One checkpoint to merge: a T5X step dir (…/checkpoint_<step>) and a display name.

    A run trained with EMA keeps its EMA weights as `ema_target` beside T5X's `target`
    (the weights its evaluation used): with `use_ema` (the default) they are the
    parameters merged, read in place of `target`, so such a checkpoint has the same tree
    as any other and an EMA run merges with runs without EMA."""

    name: str
    step_dir: Path
    use_ema: bool = True

    def __post_init__(self) -> None:
        # A LoRA run's checkpoint holds adapter factors A and B, whose mean is not the mean
        # of the updates A^T B; its export (capibara-exp-lora export) is a whole model.
        if (self.step_dir / checkpoints.LORA_POINTER).is_file():
            raise ValueError(f"{self.step_dir} is a LoRA run's checkpoint (adapter factors, "
                             "which do not merge): export it with `capibara-exp-lora export` "
                             "and merge the exports")

    @property
    def state_dir(self) -> Path:
        return self.step_dir / checkpoints.ITEM

    @functools.cached_property
    def stored_index(self) -> dict[LeafPath, LeafInfo]:
        """Every stored leaf's path, shape, dtype and partition spec (Orbax metadata)."""
        index = {}
        for path, m in checkpoints.tree_metadata(self.step_dir).items():
            sharding = getattr(m, "sharding", None)
            spec = tuple(sharding.partition_spec) if hasattr(sharding, "partition_spec") \
                else None
            index[path] = LeafInfo(tuple(m.shape), np.dtype(m.dtype), spec)
        return index

    @property
    def params_item(self) -> str:
        """Where the merged parameters are read: `ema_target` (EMA runs, use_ema) or `target`."""
        has_ema = any(p[:1] == (EMA_TARGET,) for p in self.stored_index)
        return EMA_TARGET if self.use_ema and has_ema else TARGET

    def stored_path(self, path: LeafPath) -> LeafPath:
        """The stored leaf that a merged path reads (target/... from ema_target/...)."""
        if path[:1] == (TARGET,) and self.params_item == EMA_TARGET:
            return (EMA_TARGET, *path[1:])
        return path

    @property
    def step(self) -> int:
        return int(self.step_dir.name.rsplit("_", 1)[-1])


def candidate_from_path(path: str | Path, name: str | None = None,
                        use_ema: bool = True) -> Candidate:
    """A step dir as given, or the latest finished checkpoint of a model dir."""
    path = Path(path).absolute()
    if path.name.startswith(f"{checkpoints.STEP_PREFIX}_"):
        return Candidate(name or f"{path.parent.name}/{path.name}", path, use_ema)
    found = checkpoints.steps(path)
    if not found:
        raise FileNotFoundError(f"{path}: neither a checkpoint_<step> dir nor a model dir with "
                                "finished checkpoints")
    step_dir = path / f"{checkpoints.STEP_PREFIX}_{found[-1]}"
    return Candidate(name or f"{path.name}/{step_dir.name}", step_dir, use_ema)


def last_k(model_dir: str | Path, k: int, use_ema: bool = True) -> list[Candidate]:
    """The last k finished checkpoints of one run."""
    model_dir = Path(model_dir).absolute()
    return [candidate_from_path(model_dir / f"{checkpoints.STEP_PREFIX}_{s}", f"step {s}",
                                use_ema) for s in checkpoints.steps(model_dir)[-k:]]


def leaf_index(candidate: Candidate) -> dict[LeafPath, LeafInfo]:
    """The leaves a merge sees: T5X's `state` and `target` (for an EMA run read from its
    `ema_target` when `use_ema`); the EMA copy itself is not a leaf of its own."""
    stored = candidate.stored_index
    return {p: stored[candidate.stored_path(p)] for p in stored if p[:1] != (EMA_TARGET,)}


def sharding_for(info: LeafInfo, mesh: Mesh | None) -> jax.sharding.Sharding:
    """The saved partition spec on `mesh` (when given, it has the spec's axes, e.g. a MoE
    checkpoint's `expert`, and it divides the leaf), else replicated on it; one device
    without a mesh."""
    if mesh is not None and info.spec is not None:
        try:
            sharding = NamedSharding(mesh, PartitionSpec(*info.spec))
            sharding.shard_shape(info.shape)
            return sharding
        except ValueError:  # the mesh lacks an axis of the saved spec (a MoE checkpoint's
            # `expert` on a data x model mesh) or does not divide the leaf: replicate it
            return NamedSharding(mesh, PartitionSpec())
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


class LeafReader:
    """Reads single leaves of checkpoints with TensorStore, shard by shard on `mesh`.

    Orbax's partial restore costs about 18 ms a leaf here (it re-reads the tree's
    metadata each call); opening the leaf's array in the OCDBT store directly costs
    under 1 ms, and reads only the slices this process's devices hold.
    """

    def __init__(self, mesh: Mesh | None = None):
        self.mesh = mesh
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})

    def _open(self, candidate: Candidate, path: LeafPath) -> ts.TensorStore:
        kvstore = {"driver": "ocdbt", "base": f"file://{candidate.state_dir}/",
                   "path": ".".join(candidate.stored_path(path))}
        errors = []
        for driver in ("zarr", "zarr3"):  # Orbax writes zarr v2 by default, v3 on request
            try:
                return ts.open({"driver": driver, "kvstore": kvstore}, context=self._context,
                               open=True, read=True).result()
            except ValueError as err:
                errors.append(str(err).split("[tensorstore_spec")[0])
        raise ValueError(f"{candidate.state_dir}: leaf {'.'.join(path)}: {' / '.join(errors)}")

    def _checked_open(self, candidate: Candidate, path: LeafPath, info: LeafInfo) -> ts.TensorStore:
        store = self._open(candidate, path)
        if tuple(store.shape) != info.shape:
            raise ValueError(f"{candidate.state_dir}: leaf {'.'.join(path)} has shape "
                             f"{tuple(store.shape)}, its metadata says {info.shape}")
        return store

    def read(self, candidate: Candidate, path: LeafPath, info: LeafInfo) -> np.ndarray | jax.Array:
        """One leaf: a fresh host array the caller owns (no mesh), or a jax.Array placed
        with its saved partition spec on the mesh, each device reading only its slice."""
        store = self._checked_open(candidate, path, info)
        if self.mesh is None:  # merging runs on the host: no device round trip
            return np.asarray(store.read().result()).astype(info.dtype, copy=False)
        sharding = sharding_for(info, self.mesh)
        by_device = sharding.addressable_devices_indices_map(info.shape)
        arrays = [jax.device_put(store[index].read().result().astype(info.dtype, copy=False),
                                 device) for device, index in by_device.items()]
        return jax.make_array_from_single_device_arrays(info.shape, sharding, arrays)

    def read_many(self, candidates: list[Candidate], path: LeafPath, info: LeafInfo) -> list:
        """The same leaf of several candidates. On the host every read is issued before any
        is awaited, so TensorStore decodes them (zstd, Orbax's default) on all its threads."""
        if self.mesh is not None:
            return [self.read(c, path, info) for c in candidates]
        futures = [self._checked_open(c, path, info).read() for c in candidates]
        return [np.asarray(f.result()).astype(info.dtype, copy=False) for f in futures]

    def read_subtree(self, candidate: Candidate, index: dict[LeafPath, LeafInfo],
                     prefix: LeafPath) -> dict:
        """All leaves under `prefix` (e.g. ('target',): the parameters) as a nested dict;
        on the host, every leaf's read is issued before any is awaited."""
        paths = [p for p in index if p[: len(prefix)] == prefix]
        if self.mesh is not None:
            return unflatten({p[len(prefix):]: self.read(candidate, p, index[p]) for p in paths})
        reads = [(p, self._checked_open(candidate, p, index[p]).read()) for p in paths]
        return unflatten({p[len(prefix):]: np.asarray(r.result()).astype(index[p].dtype,
                                                                          copy=False)
                          for p, r in reads})

    def close(self) -> None:
        self._context = None

    def __enter__(self) -> LeafReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unflatten(flat: dict[LeafPath, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def write(model_dir: str | Path, step: int, flat: dict[LeafPath, Any],
          lineage: list[dict] | None = None) -> Path:
    """Write a merged tree as model_dir/checkpoint_<step> in T5X layout, with its manifest
    (recording the ancestors the merged candidates share)."""
    mgr = checkpoints.manager(model_dir)
    try:
        checkpoints.save(mgr, step, unflatten(flat), kind="merge", lineage=lineage)
    finally:
        mgr.close()
    return Path(model_dir).absolute() / f"{checkpoints.STEP_PREFIX}_{step}"
