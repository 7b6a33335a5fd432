"""Rematerialisation policies by name, and by tensor (MaxText's `remat_policy` names).

The layers tag the tensors a policy may keep with `checkpoint_name` (model_facts.REMAT_NAMES:
the layer input, the query/key/value projections, the attention context, its output
projection, the MLP's input projections and its output projection). A policy says which of
them the backward pass finds saved in HBM, which it finds in pinned host memory (moved
there after the forward pass and back before the backward pass, by XLA), and which it
recomputes:

- `none`: no rematerialisation; `full`: every layer recomputed from its input;
- `dots` / `minimal`: the weight matmuls' outputs saved (dots without batch dimensions),
  attention scores recomputed;
- `save_dot_except_mlpwi`, `save_dot_except_mlp`, `save_qkv_proj`: the named projections
  saved (MaxText's presets);
- `offload`: the tensors of `remat_offload` (default: the layer input) moved to host
  memory, those of `remat_save` kept in HBM, the rest recomputed;
- `custom`: exactly `remat_save` in HBM and `remat_offload` on the host.
"""

from __future__ import annotations

import jax
from flax import linen as nn
from jax import ad_checkpoint

from capibara_exp.base import model_facts

checkpoint_name = ad_checkpoint.checkpoint_name

def policy_for(policy: str, save: tuple[str, ...] = (), offload: tuple[str, ...] = ()):
    """The jax.checkpoint policy of a name (None: no rematerialisation)."""
    policies = jax.checkpoint_policies
    if policy == "none":
        return None
    if policy == "full":
        return policies.nothing_saveable
    if policy in model_facts.REMAT_DOTS:
        return policies.dots_with_no_batch_dims_saveable
    kept, moved = model_facts.remat_names(policy, save, offload)
    if not moved:
        return policies.save_only_these_names(*kept)
    return policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(kept), names_which_can_be_offloaded=list(moved),
        offload_src="device", offload_dst="pinned_host")


def remat_layer(layer_cls: type[nn.Module], config) -> type[nn.Module]:
    """A layer class rematerialised by config.remat_policy (the class itself for 'none')."""
    policy = policy_for(config.remat_policy, config.remat_save, config.remat_offload)
    if policy is None:
        return layer_cls
    # Argument 0 is the module itself, so 5 is `enable_dropout`, a Python bool.
    return nn.remat(layer_cls, policy=policy, prevent_cse=True, static_argnums=(5,))
