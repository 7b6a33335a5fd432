"""The mesh rule: a device mesh's axis sizes, and what must divide them.

One definition used by the partitioners (runtime/partitioning.py, runtime/contrib_moe.py), the
trainer's batch check and the mesh planner's search space (tuning/mesh_space.py). Pure
functions of integers: no JAX, no devices. Errors are ValueErrors that name the setting and
the sizes, raised before anything compiles.

The mesh is (data, model) for T5X's PjitPartitioner and (data, expert, model) for
t5x.contrib.moe's: `model` is num_partitions, `expert` divides what is left, `data` takes
the rest. The batch splits over the batch axes (data, or expert x data). Over several
slices joined by the data-center network (MaxText's num_slices), only data parallelism
crosses slices: the data axis must hold a whole number of slices.
"""

from __future__ import annotations

PJIT = "partitioning.PjitPartitioner"
MOE_PJIT = "moe_partitioning.MoePjitPartitioner"


def mesh_axes(num_devices: int, num_partitions: int = 1, num_expert_partitions: int | None = None,
              *, num_slices: int = 1) -> dict[str, int]:
    """Mesh axis -> size: {'data', 'model'}, or {'data', 'expert', 'model'} when
    num_expert_partitions is given (the MoE partitioner's mesh)."""
    where = PJIT if num_expert_partitions is None else MOE_PJIT
    model = num_partitions
    if model < 1 or num_devices % model:
        raise ValueError(f"{where}: num_partitions={model} model partitions do not divide the "
                         f"{num_devices} available devices")
    data = num_devices // model
    axes = {"data": data, "model": model}
    if num_expert_partitions is not None:
        experts = num_expert_partitions
        if experts < 1 or data % experts:
            raise ValueError(f"{where}: num_expert_partitions={experts} does not divide the data "
                             f"axis ({num_devices} devices / num_partitions={model} = {data})")
        axes = {"data": data // experts, "expert": experts, "model": model}
    if axes["data"] % num_slices:
        raise ValueError(f"{where}: the data axis ({axes['data']}) is not a multiple of the "
                         f"{num_slices} slices: only data parallelism crosses slices (DCN), so "
                         f"num_partitions x num_expert_partitions must fit in one slice of "
                         f"{num_devices // num_slices} devices")
    return axes


def batch_shards(axes: dict[str, int]) -> int:
    """How many ways the batch is split: the data axis, times the expert axis if any."""
    return axes["data"] * axes.get("expert", 1)


def check_batch(batch_size: int, num_microbatches: int, shards: int, mesh: str = "") -> None:
    """A batch must split into the microbatches, and each microbatch over the batch shards;
    `mesh` describes the mesh in the error."""
    if num_microbatches < 1 or batch_size % num_microbatches:
        raise ValueError(f"batch size {batch_size} does not divide by "
                         f"trainer.Trainer.num_microbatches={num_microbatches}")
    if (batch_size // num_microbatches) % shards:
        what = "microbatch size" if num_microbatches > 1 else "batch size"
        raise ValueError(f"{what} {batch_size // num_microbatches} does not divide by the "
                         f"{shards} batch shards of the mesh" + (f" ({mesh})" if mesh else ""))


def check_model_dims(axes: dict[str, int], num_heads: int, num_experts: int | None) -> None:
    """Heads split over the model axis and experts over the expert axis, evenly."""
    if num_heads % axes["model"]:
        raise ValueError(f"model.num_heads={num_heads} does not split over a model axis of "
                         f"{axes['model']}")
    if num_experts and num_experts % axes.get("expert", 1):
        raise ValueError(f"model.num_experts={num_experts} does not split over an expert axis "
                         f"of {axes['expert']}")
