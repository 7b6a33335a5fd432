"""A lower bound on a candidate's memory per chip, known before compiling it.

An out-of-HBM candidate still costs a lowering and part of a compile (5-25 s for
moe_e2b_base on v5e-64) before XLA gives up. What a step must hold at the start of its
backward pass can be counted from the shapes alone:

- the train state, throughout: every parameter and optimizer-state leaf, split over the
  mesh axes its logical axes map to under the candidate's rules (FSDP shards 'embed' over
  'data'; MoE experts over 'expert');
- at the start of the backward pass, the activations the remat policy saved per layer for
  one microbatch's share of a chip: `full` keeps each layer's input [B, L, D]; `dots` also
  the q/k/v projections [B, L, H, K] x 3; `none` also, with dot attention, the
  probabilities [B, H, L, L]; the layer input is split over 'model' too when the
  candidate's activation sharding is `tensor` or `sequence` (base/logical_axes.py);
- at the update, the gradients: one per parameter, split alike.

The bound is the state plus the larger of the last two. Everything else (temporaries,
logits, code) only adds to it, so a candidate whose bound exceeds the HBM budget cannot
fit and is recorded infeasible without compiling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from capibara_exp.base import model_facts
from capibara_exp.tuning.mesh_space import Candidate


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the bound needs of an experiment: state leaves and the network's sizes."""

    # (shape, logical axes, bytes per element, is a parameter) of each state leaf
    leaves: tuple[tuple[tuple[int, ...], tuple[str | None, ...], int, bool], ...]
    layers: int
    emb_dim: int
    num_heads: int
    head_dim: int
    length: int
    dtype_bytes: int
    kv_heads: int = 0  # 0: num_heads
    mlp_dim: int = 0
    mlp_inputs: int = 1  # input projections of the MLP (2 when gated)
    # the experiment's per-tensor lists (model.remat_save / remat_offload)
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()


def shapes_of(bindings: dict[str, Any], model_cfg: Any) -> Shapes:
    """The state leaves (parameters, optimizer state) with their logical axes, from
    train_script's abstract state for the experiment."""
    import jax
    from jax.sharding import PartitionSpec

    from capibara_exp.runtime import train_script

    data = bindings["train_dataset_cfg"]
    length = max(data.task_feature_lengths.values())
    state, axes = train_script.state_shapes(bindings["model"], 1, length)
    leaves = []
    for tree, tree_axes, is_param in ((state.params, axes.params, True),
                                      (state.opt_state, axes.opt_state, False)):
        specs = jax.tree.leaves(tree_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for leaf, spec in zip(jax.tree.leaves(tree), specs, strict=True):
            names = tuple(spec) if len(spec) == len(leaf.shape) else (None,) * len(leaf.shape)
            leaves.append((tuple(leaf.shape), names, leaf.dtype.itemsize, is_param))
    s = model_facts.sizes(model_cfg)
    return Shapes(tuple(leaves), s.num_layers, s.emb_dim, s.num_heads, s.head_dim, length,
                  model_facts.DTYPE_BYTES.get(s.dtype, 4), s.kv_heads, s.mlp_dim,
                  s.num_mlp_inputs, tuple(model_cfg.get("remat_save") or ()),
                  tuple(model_cfg.get("remat_offload") or ()))


def _ways(shape: Sequence[int], names: Sequence[str | None], rules: Sequence[tuple],
          mesh: dict[str, int]) -> int:
    """How many ways a leaf is split: the mesh axes its logical axes map to, where the
    dimension divides (flax's first-match rule resolution, each mesh axis used once)."""
    used: set[str] = set()
    ways = 1
    for size, name in zip(shape, names, strict=True):
        for logical, mesh_axes in rules:
            if logical != name:
                continue
            axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
            if used & set(axes):
                continue
            split = math.prod(mesh.get(a, 1) for a in axes)
            if size % split == 0:
                used |= set(axes)
                ways *= split
            break
    return ways


def saved_per_token(shapes: Shapes, cand: Candidate) -> float:
    """Elements per token per chip a layer keeps in HBM for the backward pass under the
    candidate's remat policy, of the tensors the policy names (model_facts.remat_names),
    the layer input included unless it goes to host memory. The MLP's output is left out:
    only the residual add reads it, whose gradient does not (tests/test_remat.py)."""
    residual = shapes.emb_dim / (cand.model if cand.activation_sharding in ("tensor",
                                                                            "sequence") else 1)
    heads = shapes.num_heads * shapes.head_dim / cand.model
    kv = (shapes.kv_heads or shapes.num_heads) * shapes.head_dim / cand.model
    size = {"query_proj": heads, "context": heads, "key_proj": kv, "value_proj": kv,
            "out_proj": residual, "mlpwi": shapes.mlp_inputs * shapes.mlp_dim / cand.model}
    kept, moved = model_facts.remat_names(cand.remat_policy, shapes.remat_save,
                                          shapes.remat_offload)
    inputs = 0.0 if "decoder_layer_input" in moved else residual
    return inputs + sum(size.get(name, 0.0) for name in kept)


def lower_bound(shapes: Shapes, cand: Candidate, rules: Sequence[tuple]) -> float:
    """Bytes per chip the candidate's step must hold at least (see the module doc)."""
    mesh = {"data": cand.data, "expert": cand.expert, "model": cand.model}
    sharded = [(math.prod(shape) * nbytes / _ways(shape, names, rules, mesh), is_param)
               for shape, names, nbytes, is_param in shapes.leaves]
    state = sum(b for b, _ in sharded)
    grads = sum(b for b, is_param in sharded if is_param)
    batch = cand.batch_size / (cand.data * cand.expert * cand.num_microbatches)
    tokens = batch * shapes.length
    heads = shapes.num_heads / cand.model
    per_layer = tokens * saved_per_token(shapes, cand)
    if cand.remat_policy in (*model_facts.REMAT_DOTS, "none"):
        kv = (shapes.kv_heads or shapes.num_heads) / cand.model
        per_layer += tokens * (heads + 2 * kv) * shapes.head_dim
    if cand.remat_policy == "none" and cand.attention == "dot":
        per_layer += batch * heads * shapes.length * shapes.length
    return state + max(grads, shapes.layers * per_layer * shapes.dtype_bytes)
