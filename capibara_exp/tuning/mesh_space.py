"""The mesh planner's search space: mesh shapes, microbatches, remat, FSDP, per-chip batch.

Activation sharding (base/logical_axes.py) is searched only where the mesh has a model axis: with
one model partition `tensor` and `sequence` lay activations out as `batch` does.

A candidate is a set of Hydra overrides on the experiment (partitioning, trainer and model
keys), so compiling it is compiling the experiment as a user would run it. Shapes that
cannot work are left out before anything compiles, by the partitioners' own rule
(capibara_exp/base/meshes.py): model partitions that do not divide the chips or the heads,
expert partitions that do not divide the experts, microbatches that do not split the batch
over the batch shards, and over several slices, meshes whose data axis does not hold them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

from capibara_exp.base import meshes, model_facts
from capibara_exp.base.logical_axes import ACTIVATION_SHARDINGS

# Searchable policies, from the most saved to the least (model_facts owns the list).
REMAT_POLICIES = model_facts.REMAT_SEARCHED


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    data: int
    expert: int  # 1 for a dense model (no expert axis)
    model: int
    num_microbatches: int  # 1: no gradient accumulation
    remat_policy: str
    fsdp: bool  # parameters also sharded over 'data' (parameter_partitioning_dims=2)
    batch_size: int  # global
    attention: str = "dot"  # model.attention: dot | splash (nets/attention.py)
    activation_sharding: str = "batch"  # partitioning.activation_sharding (base/logical_axes.py)
    splash_block: int = 512  # model.splash_block (splash only: its kernel's blocks)
    splash_fused_bwd: bool = False  # model.splash_fused_bwd (splash only)

    @property
    def mesh(self) -> str:
        return f"{self.data}x{self.expert}x{self.model}"

    @property
    def key(self) -> str:
        return (f"mesh={self.mesh} mb={self.num_microbatches} remat={self.remat_policy} "
                f"fsdp={int(self.fsdp)} batch={self.batch_size} attn={self.attention}"
                + ("" if self.activation_sharding == "batch"
                   else f" act={self.activation_sharding}")
                + (f" block={self.splash_block}{' fused' if self.splash_fused_bwd else ''}"
                   if self.attention == "splash" else ""))

    def overrides(self, moe: bool) -> list[str]:
        """Hydra overrides that make the experiment this candidate."""
        out = [f"partitioning.num_partitions={self.model}",
               "partitioning.model_parallel_submesh=null",
               f"partitioning.parameter_partitioning_dims={2 if self.fsdp else 1}",
               f"partitioning.activation_sharding={self.activation_sharding}",
               f"trainer.num_microbatches={self.num_microbatches if self.num_microbatches > 1 else 'null'}",  # noqa: E501
               f"model.remat_policy={self.remat_policy}",
               *([] if self.remat_policy == "offload"  # its lists: the experiment's
                 else ["model.remat_save=[]", "model.remat_offload=[]"]),
               f"model.attention={self.attention}",
               f"model.splash_block={self.splash_block}",
               f"model.splash_fused_bwd={str(self.splash_fused_bwd).lower()}",
               f"data.batch_size={self.batch_size}"]
        if moe:
            out.append(f"partitioning.num_expert_partitions={self.expert}")
        return out


def _splash_choices(attention: str, blocks: Sequence[int], fused: Sequence[bool]) -> list:
    """(block, fused backward) pairs to try: all of them for splash; for dot, whose step
    does not read them, the first."""
    pairs = list(itertools.product(dict.fromkeys(blocks), dict.fromkeys(fused)))
    return pairs if attention == "splash" else pairs[:1]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(chips: int, num_heads: int, num_experts: int | None,
                model_partitions: Iterable[int] | None = None,
                expert_partitions: Iterable[int] | None = None,
                num_slices: int = 1) -> list[tuple[int, int, int]]:
    """(data, expert, model) shapes over `chips` that the partitioners accept
    (meshes.mesh_axes) and the heads and experts split over; expert is 1 for dense models."""
    shapes = set()
    for model in model_partitions or divisors(chips):
        for expert in (expert_partitions or divisors(chips)) if num_experts else [None]:
            try:
                axes = meshes.mesh_axes(chips, model, expert, num_slices=num_slices)
                meshes.check_model_dims(axes, num_heads, num_experts)
            except ValueError:
                continue
            shapes.add((axes["data"], axes.get("expert", 1), axes["model"]))
    return sorted(shapes)


def candidates(chips: int, num_heads: int, num_experts: int | None, batch_size: int, *,
               num_microbatches: Sequence[int] = (1,), remat_policies: Sequence[str] = ("none",),
               fsdp: Sequence[bool] = (False,), per_chip_batch: Sequence[int] | None = None,
               attentions: Sequence[str] = ("dot",), num_slices: int = 1,
               activation_shardings: Sequence[str] = ("batch",),
               splash_blocks: Sequence[int] = (512,), splash_fused_bwd: Sequence[bool] = (False,),
               model_partitions: Iterable[int] | None = None,
               expert_partitions: Iterable[int] | None = None) -> list[Candidate]:
    """Every valid combination; `per_chip_batch` replaces the experiment's global batch with
    per-chip sizes x chips."""
    for policy in remat_policies:
        if policy not in REMAT_POLICIES:
            raise ValueError(f"tune_mesh.remat_policies: '{policy}' is not one of "
                             f"{list(REMAT_POLICIES)}")
    for sharding in activation_shardings:
        if sharding not in ACTIVATION_SHARDINGS:
            raise ValueError(f"tune_mesh.activation_shardings: '{sharding}' is not one of "
                             f"{list(ACTIVATION_SHARDINGS)}")
    batches = [b * chips for b in per_chip_batch] if per_chip_batch else [batch_size]
    out = []
    for data, expert, model in mesh_shapes(chips, num_heads, num_experts, model_partitions,
                                           expert_partitions, num_slices):
        for batch in batches:
            for mb in num_microbatches:
                try:
                    meshes.check_batch(batch, mb, data * expert)
                except ValueError:
                    continue
                # with one model partition every activation layout is `batch`'s
                layouts = activation_shardings if model > 1 else ("batch",)
                for policy, sharded, attention, layout in itertools.product(
                        remat_policies, fsdp, attentions, dict.fromkeys(layouts)):
                    if sharded and data == 1:
                        continue  # nothing to shard parameters over
                    out += [Candidate(data, expert, model, mb, policy, bool(sharded), batch,
                                      attention, layout, block, fused)
                            for block, fused in _splash_choices(attention, splash_blocks,
                                                                splash_fused_bwd)]
    return out
