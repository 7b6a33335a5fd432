"""optax for the local engine: optimizers whose numbers live in the optimizer state.

`optax.adamw(learning_rate=..., weight_decay=0.01)` bakes its numbers into the compiled
train step as constants, so every trial of a learning-rate sweep compiles its own step.
config.gin names optimizers `hyperparams.<name>`: under engine=local that is this module,
whose optimizers below are optax's own with the same signatures, except that every float
argument, and every number of a `utils.create_learning_rate_scheduler` schedule, becomes
an array in the optimizer state; under engine=t5x the header imports optax itself under
that name. Trials that differ only in those numbers lower to one program, which XLA's
compilation cache then serves. The arrays are configuration, not training state:
checkpoints leave them out (`strip`), so the layout is T5X's, and a restore takes them from
the config (`rejoin`). An optax name that is not listed here is not available in gin under
engine=local: add it below (`name = lift(optax.name)`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from capibara_exp.runtime.utils import Schedule


class HyperparamsState(NamedTuple):
    """The wrapped transformation's numbers (float32 arrays) and its own state."""

    hyperparams: dict[str, Any]
    inner_state: Any


def _is_float(value: Any) -> bool:
    # Ints and bools stay Python values: optax uses them in shapes and control flow.
    return isinstance(value, float)


def lift(factory: Callable[..., optax.GradientTransformation]) -> Callable[..., Any]:
    """`factory` with its float arguments and schedule numbers kept in the state."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
        given = inspect.signature(factory).bind(*args, **kwargs).arguments
        lifted = {k: v for k, v in given.items() if _is_float(v) or isinstance(v, Schedule)}
        fixed = {k: v for k, v in given.items() if k not in lifted}

        def build(hyperparams: dict[str, Any]) -> optax.GradientTransformation:
            values = {k: (_bind_schedule(lifted[k], hp) if isinstance(lifted[k], Schedule) else hp)
                      for k, hp in hyperparams.items()}
            return factory(**fixed, **values)

        def init(params: Any) -> HyperparamsState:
            hyperparams = {k: (_arrays(v.hyperparams) if isinstance(v, Schedule) else
                               jnp.asarray(v, jnp.float32)) for k, v in lifted.items()}
            return HyperparamsState(hyperparams, build(hyperparams).init(params))

        def update(updates: Any, state: HyperparamsState, params: Any = None):
            updates, inner = build(state.hyperparams).update(updates, state.inner_state, params)
            return updates, HyperparamsState(state.hyperparams, inner)

        return optax.GradientTransformation(init, update)

    return make


def _arrays(numbers: dict[str, float]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v, jnp.float32) for k, v in numbers.items()}


def _bind_schedule(schedule: Schedule, hyperparams: dict[str, Any]) -> Callable:
    # Still a callable of the count: optax then keeps its schedule state, as with the
    # plain schedule, so the optimizer state has T5X's layout.
    return lambda count: schedule.at(count, **hyperparams)


def _is_wrapped(node: Any) -> bool:
    return isinstance(node, HyperparamsState)


def strip(opt_state: Any) -> Any:
    """The optimizer state as plain optax has it: the lifted numbers left out."""
    return jax.tree.map(lambda n: n.inner_state if _is_wrapped(n) else n, opt_state,
                        is_leaf=_is_wrapped)


def rejoin(template: Any, stripped: Any) -> Any:
    """`stripped` (a restored plain-optax state) with the lifted numbers of `template`."""
    return jax.tree.map(lambda t, s: t._replace(inner_state=s) if _is_wrapped(t) else s,
                        template, stripped, is_leaf=_is_wrapped)


# The optimizers config.gin may name as `hyperparams.<name>` (engine=t5x: optax's own).
adam = lift(optax.adam)
adamw = lift(optax.adamw)
adafactor = lift(optax.adafactor)
adagrad = lift(optax.adagrad)
adamax = lift(optax.adamax)
adamaxw = lift(optax.adamaxw)
lamb = lift(optax.lamb)
lion = lift(optax.lion)
nadam = lift(optax.nadam)
nadamw = lift(optax.nadamw)
rmsprop = lift(optax.rmsprop)
sgd = lift(optax.sgd)
add_decayed_weights = lift(optax.add_decayed_weights)
clip = lift(optax.clip)
clip_by_global_norm = lift(optax.clip_by_global_norm)
scale = lift(optax.scale)
