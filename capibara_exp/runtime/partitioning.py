"""T5X's `partitioning` surface: a (data, model) device mesh and logical axis rules.

The partitioner owns the mesh and the rules; `activation_context()` makes both current
while a step is traced, so the networks' logical sharding constraints (flax's
with_sharding_constraint) become real constraints instead of no-ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from capibara_exp.base import logical_axes as axes
from capibara_exp.base import meshes
from capibara_exp.runtime.utils import reject_unsupported

LogicalRules = Sequence[tuple[str, str | None]]
# Devices a partitioner lays its mesh over when not jax.devices(): the chips of a TPU
# topology that the mesh planner compiles for ahead of time (see `target_devices`).
_TARGET_DEVICES: contextvars.ContextVar[Sequence[Any] | None] = contextvars.ContextVar(
    "capibara_target_devices", default=None)


@contextlib.contextmanager
def target_devices(devices: Sequence[Any]) -> Iterator[None]:
    """Partitioners made inside lay their meshes over `devices` instead of jax.devices()."""
    token = _TARGET_DEVICES.set(list(devices))
    try:
        yield
    finally:
        _TARGET_DEVICES.reset(token)


def mesh_devices() -> list[Any]:
    """The devices a partitioner made now lays its mesh over."""
    return list(_TARGET_DEVICES.get() or jax.devices())


def num_slices(devices: Sequence[Any]) -> int:
    """TPU slices the devices span (several when joined over the data-center network)."""
    return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def device_mesh(shape: dict[str, int], devices: Sequence[Any]) -> Mesh:
    """A mesh of named axes over devices. On TPUs the devices are placed by their physical
    coordinates, so each mesh axis runs along ICI links (T5X and MaxText do the same); over
    several slices the data axis is split into slices (DCN) x devices within one (ICI), as
    MaxText's hybrid mesh with dcn_data_parallelism = num_slices."""
    sizes = tuple(shape.values())
    slices = num_slices(devices)
    if devices[0].platform == "tpu" and slices > 1:
        data = list(shape).index("data")
        ici = tuple(n // slices if i == data else n for i, n in enumerate(sizes))
        dcn = tuple(slices if i == data else 1 for i in range(len(sizes)))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                    allow_split_physical_axes=True)
    elif devices[0].platform == "tpu":
        # 32x2 or 16x4 on an 8x8 slice splits a physical axis; allowed, at some ICI cost.
        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    else:
        grid = np.asarray(devices).reshape(sizes)
    return Mesh(grid, tuple(shape))


def standard_logical_axis_rules(
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: LogicalRules | None = None,
) -> tuple[tuple[str, str | None], ...]:
    """Logical axis name -> mesh axis, as T5X's standard rules (1D: model-parallel weights)."""
    if activation_partitioning_dims not in (1, 2) or parameter_partitioning_dims not in (1, 2):
        raise ValueError("partitioning.standard_logical_axis_rules: partitioning dims must be "
                         "1 or 2, "
                         f"got activation={activation_partitioning_dims}, "
                         f"parameter={parameter_partitioning_dims}")
    rules: list[tuple[str, str | None]] = list(additional_rules or [])
    rules += [("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
              ("kv", None), ("joined_kv", "model"), ("relpos_buckets", None),
              ("abspos_buckets", None), ("length", None), ("layers", None), ("stack", None),
              ("mlp_activations", None)]
    if activation_partitioning_dims == 2:
        rules.append(("embed", "model"))
    elif parameter_partitioning_dims == 2:
        rules.append(("embed", "data"))  # shard weights over data too (FSDP-like)
    else:
        rules.append(("embed", None))
    return tuple(rules)


def with_activation_rules(rules: LogicalRules, moe: bool = False) -> tuple:
    """`rules` and, after them, the default activation rules (base/logical_axes.py, `batch`) for
    every activation name they leave out: flax gives an unnamed activation no sharding at
    all, so rules written before activations had names of their own still split the batch."""
    named = {name for name, _ in rules}
    return tuple(rules) + tuple(rule for rule in axes.activation_axis_rules("batch", moe)
                                if rule[0] not in named)


def model_partitions(num_partitions: int | None,
                     model_parallel_submesh: Sequence[int] | None) -> int:
    """The size of the model axis from T5X's two mutually exclusive ways to give it."""
    if num_partitions is not None and model_parallel_submesh is not None:
        raise ValueError("partitioning.PjitPartitioner: num_partitions and "
                         "model_parallel_submesh are mutually exclusive; set one")
    model = num_partitions or (math.prod(model_parallel_submesh) if model_parallel_submesh else 1)
    if model < 1:
        raise ValueError(f"partitioning.PjitPartitioner: num_partitions={num_partitions} / "
                         f"model_parallel_submesh={model_parallel_submesh} must be positive")
    return model


class PjitPartitioner:
    """A ('data', 'model') mesh over the local devices; params placed by logical axis rules."""

    def __init__(
        self,
        num_partitions: int | None = None,
        model_parallel_submesh: Sequence[int] | None = None,
        params_on_devices: bool = True,
        backend: str | None = None,
        ici_mesh_shape: Sequence[int] | None = None,
        dcn_mesh_shape: Sequence[int] | None = None,
        logical_axis_rules: LogicalRules | None = None,
    ):
        reject_unsupported("partitioning.PjitPartitioner", backend=backend,
                           ici_mesh_shape=ici_mesh_shape, dcn_mesh_shape=dcn_mesh_shape)
        if not params_on_devices:
            reject_unsupported("partitioning.PjitPartitioner", params_on_devices="False")
        self.num_model_partitions = model_partitions(num_partitions, model_parallel_submesh)
        devices = mesh_devices()
        self.num_slices = num_slices(devices)
        self.mesh = device_mesh(self.mesh_shape(len(devices)), devices)
        self.logical_axis_rules = with_activation_rules(
            logical_axis_rules or standard_logical_axis_rules(), moe=self.moe_rules)

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Mesh axis -> size for a device count (the mesh rule, capibara_exp/base/meshes.py)."""
        return meshes.mesh_axes(num_devices, self.num_model_partitions,
                                num_slices=self.num_slices)

    moe_rules = False  # the default activation rules split the batch over (expert, data)
    # Mesh axes the batch dimension is split over (T5X: data_partition_spec).
    batch_axes: tuple[str, ...] = ("data",)

    @property
    def data_partition_spec(self) -> PartitionSpec:
        return PartitionSpec(self.batch_axes)

    @property
    def data_size(self) -> int:
        """How many ways the batch is split: a batch must divide by it."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def data_sharding(self) -> NamedSharding:
        """Batch dimension split over the batch axes."""
        return NamedSharding(self.mesh, self.data_partition_spec)

    def check_batch_size(self, batch_size: int) -> None:
        """A batch that does not split evenly over the mesh is an error before compiling."""
        meshes.check_batch(batch_size, 1, self.data_size, self.describe())

    def describe(self) -> str:
        """The mesh in words, for errors: axis sizes and the axes the batch splits over."""
        shape = " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        return f"mesh {shape}; batch split over {self.batch_axes}"

    def activation_context(self) -> contextlib.ExitStack:
        """Mesh and logical axis rules in force, so activation constraints apply when traced."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn_partitioning.axis_rules(self.logical_axis_rules))
        return stack

    def check_divisible(self, params: Any, param_axes: Any) -> None:
        """Every sharded parameter dimension must split evenly over its mesh axes: an error
        naming the parameter, its shape and the mesh axis, before anything compiles."""
        flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
        flat_axes = jax.tree.leaves(param_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for (path, leaf), logical in zip(flat_params, flat_axes, strict=True):
            spec = nn.logical_to_mesh_axes(logical, self.logical_axis_rules)
            for dim, (size, mesh_axes) in enumerate(zip(leaf.shape, spec, strict=False)):
                names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
                ways = math.prod(self.mesh.shape[a] for a in names)
                if size % ways:
                    raise ValueError(
                        f"parameter {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)}: "
                        f"dimension {dim} ({size}, logical axis '{logical[dim]}') does not split "
                        f"over mesh axis {names} of size {ways} (mesh {dict(self.mesh.shape)})")

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shardings(self, logical_axes):
        """A pytree of PartitionSpecs of logical names -> NamedShardings on this mesh."""
        return nn.logical_to_mesh_sharding(logical_axes, self.mesh, self.logical_axis_rules)
