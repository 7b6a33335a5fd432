"""T5X's `optimizers` surface for optax: `chain` and `OptaxWrapper`."""

from __future__ import annotations

from collections.abc import Sequence

import optax


class OptaxWrapper:
    """An optax GradientTransformation as a model's `optimizer_def` (T5X: OptaxWrapper)."""

    def __init__(self, optax_optimizer: optax.GradientTransformation):
        self.optax_optimizer = optax_optimizer


def chain(transformations: Sequence[optax.GradientTransformation]) -> OptaxWrapper:
    """optax.chain of the transformations, wrapped (T5X: optimizers.chain)."""
    return OptaxWrapper(optax.chain(*transformations))
