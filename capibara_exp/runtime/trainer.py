"""T5X's `trainer` surface: the jitted train/eval steps, microbatching, and actions."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import serialization, traverse_util

from capibara_exp.runtime.config import reject_unsupported


@flax.struct.dataclass
class TrainState:
    """Step, parameters and optimizer state; a pure pytree."""

    step: jnp.ndarray
    params: Any
    opt_state: Any

    def state_dict(self) -> dict:
        """T5X's checkpoint tree: {'state': {'step', 'param_states'}, 'target': params}.

        As T5X's OptaxWrapper does, the optax state is a state dict without the empty
        nodes of stateless transformations (optax.EmptyState), so the trees match.
        """
        flat = traverse_util.flatten_dict(serialization.to_state_dict(self.opt_state), sep="/")
        return {"state": {"step": self.step,
                          "param_states": traverse_util.unflatten_dict(flat, sep="/")},
                "target": self.params}

    def restore_state(self, tree: Mapping) -> TrainState:
        """The inverse of state_dict: empty nodes come back from this state's own structure."""
        reference = traverse_util.flatten_dict(serialization.to_state_dict(self.opt_state),
                                               keep_empty_nodes=True, sep="/")
        given = traverse_util.flatten_dict(dict(tree["state"]["param_states"]), sep="/")
        for key, value in reference.items():
            if key not in given:
                if value is not traverse_util.empty_node:
                    raise ValueError(f"checkpoint has no optimizer state at param_states/{key}")
                given[key] = value
        opt_state = serialization.from_state_dict(
            self.opt_state, traverse_util.unflatten_dict(given, sep="/"))
        return self.replace(step=jnp.asarray(tree["state"]["step"]), params=tree["target"],
                            opt_state=opt_state)


class BaseAction(abc.ABC):
    """Runs after an evaluation (mode TRAIN_EVAL) or a train period (TRAIN); True stops training."""

    @abc.abstractmethod
    def run(self, train_state: TrainState, metrics_by_task: Mapping[str, Any]) -> bool:
        ...


def _split_microbatches(batch: dict, num: int) -> dict:
    return jax.tree.map(lambda x: x.reshape((num, x.shape[0] // num) + x.shape[1:]), batch)


class Trainer:
    """Owns the compiled train and eval steps for one model, state layout and mesh."""

    def __init__(
        self,
        model: Any,
        train_state: TrainState,
        partitioner: Any,
        eval_names: Any,
        summary_dir: str | None,
        train_state_axes: Any,
        rng: jax.Array,
        learning_rate_fn: Callable[[jnp.ndarray], jnp.ndarray],
        num_microbatches: int | None,
        weight_metrics_computer: Any = None,
    ):
        reject_unsupported("trainer.Trainer", weight_metrics_computer=weight_metrics_computer)
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(f"trainer.Trainer.num_microbatches must be >= 1, got {num_microbatches}")
        del eval_names, summary_dir, train_state  # T5X's signature; the loop writes summaries
        self.model = model
        self.partitioner = partitioner
        self.learning_rate_fn = learning_rate_fn
        self.num_microbatches = num_microbatches or 1
        self._rng = rng
        self._tx = model.optimizer_def.optax_optimizer
        state_shardings = partitioner.shardings(train_state_axes)
        data, replicated = partitioner.data_sharding(), partitioner.replicated()
        self.state_shardings = state_shardings
        self._train_step = jax.jit(self._step, in_shardings=(state_shardings, data),
                                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        self._eval_step = jax.jit(self._eval, in_shardings=(state_shardings.params, data),
                                  out_shardings=replicated)

    def check_batch_size(self, batch_size: int) -> None:
        data = self.partitioner.data_size
        if batch_size % self.num_microbatches:
            raise ValueError(f"batch size {batch_size} does not divide by "
                             f"trainer.Trainer.num_microbatches={self.num_microbatches}")
        if (batch_size // self.num_microbatches) % data:
            raise ValueError(f"microbatch size {batch_size // self.num_microbatches} does not divide "
                             f"by the mesh's data axis ({data} devices)")

    def _grads(self, params: Any, batch: dict, rng: jax.Array) -> tuple[Any, dict]:
        grad_fn = jax.value_and_grad(self.model.loss_fn, has_aux=True)
        if self.num_microbatches == 1:
            (_, sums), grads = grad_fn(params, batch, rng)
            return grads, sums

        def body(carry, mb_and_index):
            grads_acc, sums_acc = carry
            mb, index = mb_and_index
            (_, sums), grads = grad_fn(params, mb, jax.random.fold_in(rng, index))
            return (jax.tree.map(jnp.add, grads_acc, grads), jax.tree.map(jnp.add, sums_acc, sums)), None

        micro = _split_microbatches(batch, self.num_microbatches)
        first = jax.tree.map(lambda x: x[0], micro)
        zeros_g = jax.tree.map(jnp.zeros_like, params)
        zeros_s = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: grad_fn(params, first, rng)[0][1]))
        (grads, sums), _ = jax.lax.scan(body, (zeros_g, zeros_s),
                                        (micro, jnp.arange(self.num_microbatches)))
        return grads, sums

    def _step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(self._rng, state.step)
        grads, sums = self._grads(state.params, batch, rng)
        updates, opt_state = self._tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(sums, grad_norm=optax.tree.norm(grads),
                       learning_rate=self.learning_rate_fn(state.step))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def _eval(self, params: Any, batch: dict) -> dict:
        return self.model.loss_fn(params, batch, None)[1]

    def train_step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        return self._train_step(state, batch)

    def eval_step(self, state: TrainState, batch: dict) -> dict:
        return self._eval_step(state.params, batch)
