"""Frozen parameters as an optax wrapper: the wrapped optimizer sees zero gradients for
them, their updates are zero and their optimizer state (moments) stays as it was, so a
frozen leaf is exactly unchanged, weight decay included, and its moments resume where
they were when it thaws (as torch's optimizers skip parameters without gradients). The
state keeps the wrapped optimizer's structure, so checkpoints do not change."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def freeze(tx: optax.GradientTransformation, trainable: Any) -> optax.GradientTransformation:
    """`tx` with the leaves where `trainable` (a tree of bools like the params) is False
    frozen."""
    params_def = jax.tree.structure(trainable)

    def zero_frozen(tree: Any) -> Any:
        return jax.tree.map(lambda x, t: x if t else jnp.zeros_like(x), tree, trainable)

    def keep_frozen_state(new: Any, old: Any) -> Any:
        def pick(n: Any, o: Any) -> Any:  # a part of the state shaped like the params
            if jax.tree.structure(n) != params_def:
                return n
            return jax.tree.map(lambda a, b, t: a if t else b, n, o, trainable)

        return jax.tree.map(pick, new, old,
                            is_leaf=lambda x: jax.tree.structure(x) == params_def)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, new_state = tx.update(zero_frozen(grads), state, params)
        return zero_frozen(updates), keep_frozen_state(new_state, state)

    return optax.GradientTransformation(tx.init, update)
