"""Logical axis names of the networks' activations, apart from their weights' names, and the
rules that map them onto the mesh (MaxText's convention: `activation_embed`, ...).

Weights carry T5X's names (`embed`, `mlp`, `heads`, `joined_kv`, `vocab`); with FSDP
(parameter_partitioning_dims=2) `embed` maps to 'data'. An activation named `embed` too
would follow the weights' rule, and the residual stream [batch, length, embed] could never
be split over the tensor ('model') axis. So activations have their own names, and
`activation_axis_rules(sharding)` says where they go:

- `batch`: the batch over 'data' (and 'expert'), the heads, MLP hidden units and vocabulary
  over 'model', the residual stream replicated over 'model': T5X's standard 1-D rules, the
  layout before activations had names of their own.
- `tensor`: also the residual stream's embedding dimension over 'model' (MaxText's
  `activation_embed: tensor`): what the layers save for the backward pass is split by the
  tensor-parallel degree.
- `sequence`: the residual stream's length over 'model' instead (sequence parallelism over
  the tensor axis, as Megatron-LM pairs it with tensor parallelism); inside the blocks,
  heads and MLP units stay on 'model'.

The rules are additional rules for T5X's (and the local runtime's) standard_logical_axis_rules,
so both engines read them from the same gin binding. A leaf module: no JAX.
"""

from __future__ import annotations

BATCH, LENGTH, EMBED = "activation_batch", "activation_length", "activation_embed"
HEADS, KV_HEADS, KV = "activation_heads", "activation_kv_heads", "activation_kv"
MLP, VOCAB = "activation_mlp", "activation_vocab"

RESIDUAL = (BATCH, LENGTH, EMBED)  # [B, L, D] between and around the blocks
QUERY = (BATCH, LENGTH, HEADS, KV)  # [B, L, H, K]
KEY_VALUE = (BATCH, LENGTH, KV_HEADS, KV)  # [B, L, G, K]
HIDDEN = (BATCH, LENGTH, MLP)  # [B, L, F]
LOGITS = (BATCH, LENGTH, VOCAB)  # [B, L, V]

ACTIVATION_SHARDINGS = ("batch", "tensor", "sequence")


def activation_axis_rules(sharding: str = "batch", moe: bool = False
                          ) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Activation name -> mesh axis for one of ACTIVATION_SHARDINGS. Flax resolves names in
    rule order and gives each mesh axis to one dimension of an array, so the heads, MLP and
    vocabulary rules come before the length rule: inside a block 'model' splits the heads,
    and only the residual stream (no heads) has its length split under `sequence`."""
    if sharding not in ACTIVATION_SHARDINGS:
        raise ValueError(f"partitioning.activation_sharding: {sharding!r} is not one of "
                         f"{list(ACTIVATION_SHARDINGS)}")
    batch: str | tuple[str, ...] = ("expert", "data") if moe else "data"
    rules: list[tuple[str, str | tuple[str, ...] | None]] = [
        (BATCH, batch), (HEADS, "model"), (MLP, "model"), (VOCAB, "model"),
        # grouped key/value heads may be fewer than the model partitions: replicated
        (KV_HEADS, None), (KV, None)]
    rules.append((EMBED, "model" if sharding == "tensor" else None))
    rules.append((LENGTH, "model" if sharding == "sequence" else None))
    return tuple(rules)
