"""T5X's `trainer` surface: the jitted train/eval steps, microbatching, and actions."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import serialization, traverse_util

from capibara_exp.runtime import hyperparams
from capibara_exp.runtime.utils import reject_unsupported


@flax.struct.dataclass
class TrainState:
    """Step, parameters and optimizer state; a pure pytree."""

    step: jnp.ndarray
    params: Any
    opt_state: Any
    ema_params: Any = None  # an exponential moving average of params, when the trainer keeps one

    def state_dict(self) -> dict:
        """T5X's checkpoint tree: {'state': {'step', 'param_states'}, 'target': params}.

        As T5X's OptaxWrapper does, the optax state is a state dict without the empty
        nodes of stateless transformations (optax.EmptyState), so the trees match.
        """
        flat = traverse_util.flatten_dict(
            serialization.to_state_dict(hyperparams.strip(self.opt_state)), sep="/")
        tree = {"state": {"step": self.step,
                          "param_states": traverse_util.unflatten_dict(flat, sep="/")},
                "target": self.params}
        if self.ema_params is not None:  # beside T5X's keys, so a resume is exact
            tree["ema_target"] = self.ema_params
        return tree

    def restore_state(self, tree: Mapping) -> TrainState:
        """The inverse of state_dict: empty nodes come back from this state's own structure."""
        plain = hyperparams.strip(self.opt_state)  # numbers from the config, not the file
        reference = traverse_util.flatten_dict(serialization.to_state_dict(plain),
                                               keep_empty_nodes=True, sep="/")
        given = traverse_util.flatten_dict(dict(tree["state"]["param_states"]), sep="/")
        for key, value in reference.items():
            if key not in given:
                if value is not traverse_util.empty_node:
                    raise ValueError(f"checkpoint has no optimizer state at param_states/{key}")
                given[key] = value
        opt_state = hyperparams.rejoin(self.opt_state, serialization.from_state_dict(
            plain, traverse_util.unflatten_dict(given, sep="/")))
        if (self.ema_params is None) != ("ema_target" not in tree):
            raise ValueError("checkpoint and run disagree on EMA weights (ema_target): a run "
                             "with ema_decay set resumes only from a checkpoint with EMA")
        return self.replace(step=jnp.asarray(tree["state"]["step"]), params=tree["target"],
                            opt_state=opt_state, ema_params=tree.get("ema_target"))


@dataclasses.dataclass(frozen=True)
class FrozenInputs:
    """Arrays a model reads in every step but never trains (a LoRA run's base model). The
    train and eval steps take them as an argument placed by their logical axes, like the
    state: sharded over the mesh, never constants baked into the compiled program, and not
    part of the checkpointed state. A model offers them with `frozen_inputs()` and takes
    them back as `loss_fn(params, batch, dropout_rng, frozen=...)`."""

    shapes: Any  # a tree of jax.ShapeDtypeStruct
    axes: Any  # the same tree, of PartitionSpecs of logical axis names
    load: Callable[[Any], Any]  # the tree of NamedShardings -> the arrays, placed on them


class BaseAction(abc.ABC):
    """Runs after an evaluation (mode TRAIN_EVAL) or a train period (TRAIN); True stops training."""

    @abc.abstractmethod
    def run(self, train_state: TrainState, metrics_by_task: Mapping[str, Any]) -> bool:
        ...


class EarlyStoppingAction(BaseAction):
    """T5X's EarlyStoppingAction: stop when `metric` = (task, name) has not improved over the
    last `patience` evaluations (each change within atol + rtol * |previous| is no improvement)."""

    def __init__(self, metric: tuple[str, str], mode: str, patience: int = 3,
                 atol: float = 0.0, rtol: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError("trainer.EarlyStoppingAction.mode must be 'min' or 'max', "
                             f"got {mode!r}")
        if atol < 0 or rtol < 0:
            raise ValueError(f"trainer.EarlyStoppingAction: atol and rtol must be >= 0, "
                             f"got atol={atol}, rtol={rtol}")
        if patience < 1:
            raise ValueError(f"trainer.EarlyStoppingAction.patience must be >= 1, got {patience}")
        self.task, self.metric = metric
        self.mode, self.patience, self.atol, self.rtol = mode, patience, atol, rtol
        self.history: list[float] = []

    def _no_better(self, current: float, previous: float) -> bool:
        delta = self.atol + self.rtol * abs(previous)
        if self.mode == "min":
            return current >= previous - delta
        return current <= previous + delta

    def run(self, train_state: TrainState, metrics_by_task: Mapping[str, Any]) -> bool:
        if not metrics_by_task:  # no evaluation at this step
            return False
        value = metrics_by_task.get(self.task, {}).get(self.metric)
        if value is None:  # T5X warns and does not run; an unknown name here is a typo
            known = {t: sorted(m) for t, m in metrics_by_task.items()}
            raise ValueError(f"trainer.EarlyStoppingAction.metric={(self.task, self.metric)!r}: "
                             f"no such train-eval metric (have {known})")
        self.history.append(float(value))
        if len(self.history) < self.patience:
            return False
        if all(self._no_better(self.history[i + 1], self.history[i])
               for i in range(self.patience - 1)):
            return True
        self.history.pop(0)
        return False


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
        ema_decay: float | None = None,
        skip_nonfinite_updates: bool = False,
        max_consecutive_skips: int = 3,
        update_mask: Any = None,
    ):
        """T5X's Trainer; `ema_decay`, `skip_nonfinite_updates` and `max_consecutive_skips`
        are the local engine's own (T5X has neither EMA weights nor a skip-step policy)."""
        reject_unsupported("trainer.Trainer", weight_metrics_computer=weight_metrics_computer)
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(f"trainer.Trainer.num_microbatches: {num_microbatches} < 1")
        if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"trainer.Trainer.ema_decay must be in [0, 1), got {ema_decay}")
        if max_consecutive_skips < 1:
            raise ValueError("trainer.Trainer.max_consecutive_skips must be >= 1, "
                             f"got {max_consecutive_skips}")
        partitioner.check_divisible(train_state.params, train_state_axes.params)  # before compile
        self.frozen = model.frozen_inputs() if hasattr(model, "frozen_inputs") else None
        frozen_shardings = None
        if self.frozen is not None:
            partitioner.check_divisible(self.frozen.shapes, self.frozen.axes)
            frozen_shardings = partitioner.shardings(self.frozen.axes)
        self._frozen_shardings, self._frozen_values = frozen_shardings, None
        del eval_names, summary_dir, train_state  # T5X's signature; the loop writes summaries
        self.model = model
        self.partitioner = partitioner
        self.learning_rate_fn = learning_rate_fn
        self._learning_rate = jax.jit(lambda step: learning_rate_fn(step))
        self.num_microbatches = num_microbatches or 1
        self.ema_decay = ema_decay
        self.skip_nonfinite_updates = skip_nonfinite_updates
        self.max_consecutive_skips = max_consecutive_skips
        self._rng = rng
        self._tx = model.optimizer_def.optax_optimizer
        if update_mask is not None:  # a curriculum stage's frozen modules (runtime/freeze.py)
            from capibara_exp.runtime.freeze import freeze

            self._tx = freeze(self._tx, update_mask)
        if ema_decay is not None:
            train_state_axes = train_state_axes.replace(ema_params=train_state_axes.params)
        state_shardings = partitioner.shardings(train_state_axes)
        data, replicated = partitioner.data_sharding(), partitioner.replicated()
        self.state_shardings = state_shardings
        self._train_step = jax.jit(self._step,
                                   in_shardings=(state_shardings, frozen_shardings, data),
                                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        self._eval_step = jax.jit(self._eval,
                                  in_shardings=(state_shardings.params, frozen_shardings, data),
                                  out_shardings=replicated)

    def prepare_state(self, state: TrainState) -> TrainState:
        """The state this trainer steps: with EMA weights (a copy of params) when it keeps them."""
        if self.ema_decay is not None and state.ema_params is None:
            state = state.replace(ema_params=jax.tree.map(jnp.array, state.params))
        self.frozen_values()  # read now: a bad base checkpoint fails before any data is read
        return jax.device_put(state, self.state_shardings)

    def frozen_values(self) -> Any:
        """The model's frozen inputs on the mesh (read once), or None for a model without."""
        if self.frozen is not None and self._frozen_values is None:
            self._frozen_values = self.frozen.load(self._frozen_shardings)
        return self._frozen_values

    def reload_frozen(self) -> None:
        """Read the frozen inputs again at the next step (FedProx's anchor, each round)."""
        self._frozen_values = None

    def _loss_fn(self, frozen: Any) -> Callable:
        if frozen is None:
            return self.model.loss_fn
        return functools.partial(self.model.loss_fn, frozen=frozen)

    def check_batch_size(self, batch_size: int) -> None:
        from capibara_exp.base.meshes import check_batch  # the one mesh rule (imported here only to
        # keep this change to the method: trainer.py is being reworked in parallel)

        check_batch(batch_size, self.num_microbatches, self.partitioner.data_size)

    def _grads(self, params: Any, batch: dict, rng: jax.Array, frozen: Any = None
               ) -> tuple[Any, dict]:
        grad_fn = jax.value_and_grad(self._loss_fn(frozen), has_aux=True)
        if self.num_microbatches == 1:
            (_, sums), grads = grad_fn(params, batch, rng)
            return grads, sums

        def body(carry, mb_and_index):
            grads_acc, sums_acc = carry
            mb, index = mb_and_index
            (_, sums), grads = grad_fn(params, mb, jax.random.fold_in(rng, index))
            added = jax.tree.map(jnp.add, grads_acc, grads), jax.tree.map(jnp.add, sums_acc, sums)
            return added, None

        micro = _split_microbatches(batch, self.num_microbatches)
        first = jax.tree.map(lambda x: x[0], micro)
        zeros_g = jax.tree.map(jnp.zeros_like, params)
        sums_shape = jax.eval_shape(lambda: grad_fn(params, first, rng)[0][1])
        zeros_s = jax.tree.map(jnp.zeros_like, sums_shape)
        (grads, sums), _ = jax.lax.scan(body, (zeros_g, zeros_s),
                                        (micro, jnp.arange(self.num_microbatches)))
        return grads, sums

    def _step(self, state: TrainState, frozen: Any, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(self._rng, state.step)
        grads, sums = self._grads(state.params, batch, rng, frozen)
        updates, opt_state = self._tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if self.ema_decay is not None:
            new = new.replace(ema_params=jax.tree.map(
                lambda e, p: self.ema_decay * e + (1.0 - self.ema_decay) * p,
                state.ema_params, params))
        grad_norm = optax.tree.norm(grads)
        metrics = dict(sums, grad_norm=grad_norm)
        if self.skip_nonfinite_updates:
            new, metrics = _skip_if_nonfinite(state, new, metrics)
        return new, metrics

    def _eval(self, params: Any, frozen: Any, batch: dict) -> dict:
        return self._loss_fn(frozen)(params, batch, None)[1]

    def train_step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        # The mesh and axis rules in force when jit traces make the nets' constraints real.
        # The logged rate is computed beside the step, not in it: its schedule's numbers
        # would be constants of the step, and a sweep's trials could not share it.
        learning_rate = self._learning_rate(state.step)
        with self.partitioner.activation_context():
            state, metrics = self._train_step(state, self.frozen_values(), batch)
        return state, dict(metrics, learning_rate=learning_rate)

    def lower_train_step(self, state: TrainState, batch: dict) -> jax.stages.Lowered:
        """The train step lowered for abstract inputs (jax.ShapeDtypeStruct trees), as
        train_step would compile it: for ahead-of-time compiles on a target topology."""
        if self.ema_decay is not None and state.ema_params is None:
            state = state.replace(ema_params=state.params)
        frozen = None if self.frozen is None else self.frozen.shapes
        with self.partitioner.activation_context():
            return self._train_step.lower(state, frozen, batch)

    def eval_step(self, state: TrainState, batch: dict) -> dict:
        """Metric sums of one batch, with the EMA weights where the trainer keeps them."""
        params = state.params if state.ema_params is None else state.ema_params
        with self.partitioner.activation_context():
            return self._eval_step(params, self.frozen_values(), batch)


def _skip_if_nonfinite(old: TrainState, new: TrainState, metrics: dict
                       ) -> tuple[TrainState, dict]:
    """Keep the old params/optimizer/EMA when the loss or gradient is NaN/Inf; the step (the
    data position) still advances. A skipped step's sums are zeroed so window means stay finite."""
    finite = jnp.isfinite(metrics["loss_sum"]) & jnp.isfinite(metrics["grad_norm"])
    keep = lambda n, o: jnp.where(finite, n, o)  # noqa: E731
    state = new.replace(params=jax.tree.map(keep, new.params, old.params),
                        opt_state=jax.tree.map(keep, new.opt_state, old.opt_state),
                        ema_params=jax.tree.map(keep, new.ema_params, old.ema_params))
    metrics = {k: (jnp.where(finite, v, 0.0) if k != "learning_rate" else v)
               for k, v in metrics.items()}
    return state, dict(metrics, skipped_steps=1.0 - finite.astype(jnp.float32))
