"""T5X's `partitioning` surface: a (data, model) device mesh and logical axis rules."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from capibara_exp.runtime.config import reject_unsupported

LogicalRules = Sequence[tuple[str, str | None]]


def standard_logical_axis_rules(
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: LogicalRules | None = None,
) -> tuple[tuple[str, str | None], ...]:
    """Logical axis name -> mesh axis, as T5X's standard rules (1D: model-parallel weights)."""
    if activation_partitioning_dims not in (1, 2) or parameter_partitioning_dims not in (1, 2):
        raise ValueError("partitioning.standard_logical_axis_rules: partitioning dims must be 1 or 2, "
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
        if num_partitions is not None and model_parallel_submesh is not None:
            raise ValueError("partitioning.PjitPartitioner: num_partitions and "
                             "model_parallel_submesh are mutually exclusive; set one")
        reject_unsupported("partitioning.PjitPartitioner", backend=backend,
                           ici_mesh_shape=ici_mesh_shape, dcn_mesh_shape=dcn_mesh_shape)
        if not params_on_devices:
            reject_unsupported("partitioning.PjitPartitioner", params_on_devices="False")
        model = num_partitions or (math.prod(model_parallel_submesh) if model_parallel_submesh else 1)
        devices = jax.devices()
        if model < 1 or len(devices) % model:
            raise ValueError(f"partitioning.PjitPartitioner: {model} model partitions do not divide "
                             f"the {len(devices)} available devices")
        self.mesh = Mesh(np.asarray(devices).reshape(len(devices) // model, model), ("data", "model"))
        self.logical_axis_rules = tuple(logical_axis_rules or standard_logical_axis_rules())

    @property
    def data_size(self) -> int:
        return self.mesh.shape["data"]

    def data_sharding(self) -> NamedSharding:
        """Batch dimension split over 'data'."""
        return NamedSharding(self.mesh, PartitionSpec("data"))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shardings(self, logical_axes):
        """A pytree of PartitionSpecs of logical names -> NamedShardings on this mesh."""
        return nn.logical_to_mesh_sharding(logical_axes, self.mesh, self.logical_axis_rules)
