"""Federated consensus: FedAvg rounds over client shards of a task, optionally with DP.

Clients are simulated in one process. Each round every client starts from the global
parameters, takes a few local steps of the run's own trainer on its shard of the task
(seqio.ShardInfo), and sends back its parameter delta. Clients keep no optimizer state
between rounds (fresh moments each round), while the learning-rate schedule follows the
global step, so warm-up and decay advance round by round. With DP, each delta is clipped to
`clip_norm` and the average gets Gaussian noise of std noise_multiplier * clip_norm /
num_clients (DP-FedAvg, McMahan et al. 2018); epsilon comes from dp-accounting's RDP
accountant.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from capibara_exp.consensus.run import RunParts
from capibara_exp.runtime.trainer import TrainState

REPORT = "fedavg_report.json"


@dataclasses.dataclass(frozen=True)
class FedConfig:
    num_clients: int = 4
    rounds: int = 3
    local_steps: int = 2
    clip_norm: float | None = None        # DP: per-client L2 clip of the delta
    noise_multiplier: float = 0.0         # DP: noise std / clip_norm (on the sum)
    target_delta: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        def whole(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def real(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        for name in ("num_clients", "rounds", "local_steps"):
            if not (whole(getattr(self, name)) and getattr(self, name) >= 1):
                raise ValueError(f"fedavg.{name} must be an integer >= 1, got "
                                 f"{getattr(self, name)!r}")
        if self.clip_norm is not None and not (real(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"fedavg.clip_norm must be a finite number > 0 or null, got "
                             f"{self.clip_norm!r}")
        if not (real(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"fedavg.noise_multiplier must be a finite number >= 0, got "
                             f"{self.noise_multiplier!r}")
        if not (real(self.target_delta) and 0 < self.target_delta < 1):
            raise ValueError(f"fedavg.target_delta must be in (0, 1), got {self.target_delta!r}")
        if not whole(self.seed):
            raise ValueError(f"fedavg.seed must be an integer, got {self.seed!r}")


def client_batches(parts: RunParts, client: int, num_clients: int) -> Iterator[dict]:
    """Batches of one client's shard of the training task (a seqio shard, repeated)."""
    import seqio

    from capibara_exp.runtime import inputs

    cfg = parts.train_dataset_cfg
    inputs.import_modules(cfg)
    ds = seqio.get_dataset(cfg.mixture_or_task_name, cfg.task_feature_lengths,
                           feature_converter=parts.model.FEATURE_CONVERTER_CLS(pack=cfg.pack),
                           dataset_split=cfg.split, shuffle=cfg.shuffle, num_epochs=None,
                           seed=client, shard_info=seqio.ShardInfo(client, num_clients),
                           use_cached=False)
    return ds.batch(cfg.batch_size, drop_remainder=True).as_numpy_iterator()


def build_trainer(parts: RunParts, seed: int) -> tuple[Any, TrainState]:
    """The run's trainer (compiled once) and its initial state."""
    from capibara_exp.runtime.state import initial_state, make_trainer

    cfg = parts.train_dataset_cfg
    length = max(cfg.task_feature_lengths.values())
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    state, axes = initial_state(parts.model, init_rng, cfg.batch_size, length)
    trainer = make_trainer(parts.trainer_cls, parts.model, parts.partitioner, state, axes,
                           dropout_rng, cfg.batch_size, None, **parts.trainer_features)
    return trainer, trainer.prepare_state(state)


def local_steps(trainer: Any, state: TrainState, batches: Iterator[dict], steps: int) -> TrainState:
    """`steps` real train steps of the run's trainer."""
    sharding = trainer.partitioner.data_sharding()
    for _ in range(steps):
        state, _ = trainer.train_step(state, jax.device_put(next(batches), sharding))
    return state


_COUNTED = (optax.ScaleByScheduleState, optax.InjectStatefulHyperparamsState)


def with_schedule_count(opt_state: Any, count: int) -> Any:
    """opt_state with every schedule counter set to `count` and all else as given.

    FedAvg's clients start each round from fresh optimizer moments (the state the round
    starts from is the initial one), but the learning-rate schedule follows the global
    step, as it would in one run: round r's local steps use the rates of steps
    r * local_steps onwards, so warm-up and decay advance across rounds.
    """
    def set_count(node: Any) -> Any:
        if isinstance(node, _COUNTED):
            return node._replace(count=jnp.asarray(count, jnp.asarray(node.count).dtype))
        return node

    return jax.tree.map(set_count, opt_state, is_leaf=lambda n: isinstance(n, _COUNTED))


def clip(delta: Any, clip_norm: float) -> Any:
    """Scale a pytree to L2 norm at most clip_norm."""
    norm = optax.tree.norm(delta)
    return jax.tree.map(lambda d: d * jnp.minimum(1.0, clip_norm / (norm + 1e-12)), delta)


# The round's arithmetic, one compiled program each (op by op, every leaf shape of every
# tree operation compiled on its own: about a hundred compiles for a tiny model).
@jax.jit
def _zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


@jax.jit
def _fresh_copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)  # the train step donates its input


@functools.partial(jax.jit, static_argnames=("clip_norm",))
def _add_client(total: Any, local: Any, start: Any, clip_norm: float | None) -> Any:
    delta = jax.tree.map(jnp.subtract, local, start)
    if clip_norm is not None:
        delta = clip(delta, clip_norm)
    return jax.tree.map(jnp.add, total, delta)


@jax.jit
def _apply_mean(params: Any, total: Any, noise: Any, num_clients: int) -> tuple[Any, Any]:
    """(params + the mean client update with its noise, that update's L2 norm)."""
    mean = jax.tree.map(lambda t, z: t / num_clients + z, total, noise)
    return jax.tree.map(jnp.add, params, mean), optax.tree.norm(mean)


def epsilon(cfg: FedConfig) -> float | None:
    """(epsilon, target_delta)-DP of the rounds by RDP accounting (every client every round)."""
    if cfg.clip_norm is None or cfg.noise_multiplier <= 0:
        return None
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(cfg.noise_multiplier), cfg.rounds)
    return float(accountant.get_epsilon(cfg.target_delta))


def fedavg(parts: RunParts, cfg: FedConfig, evaluator: Any = None,
           out_dir: str | Path | None = None) -> tuple[TrainState, dict]:
    """Run FedAvg; returns the global state and a report (per round: the schedule's learning
    rate at its first local step, the norm of the global update, the validation loss; and
    epsilon).

    With out_dir, the global state is written there as a T5X-layout checkpoint (with its
    manifest) beside fedavg_report.json.
    """
    trainer, global_state = build_trainer(parts, cfg.seed)
    fresh_opt_state = global_state.opt_state  # the moments every round starts from
    streams = [client_batches(parts, c, cfg.num_clients) for c in range(cfg.num_clients)]
    rng = np.random.default_rng(cfg.seed)
    history = []
    for r in range(cfg.rounds):
        step = int(jax.device_get(global_state.step))
        round_start = global_state.replace(opt_state=with_schedule_count(fresh_opt_state, step))
        total = _zeros(global_state.params)
        for c in range(cfg.num_clients):
            local = local_steps(trainer, _fresh_copy(round_start), streams[c], cfg.local_steps)
            total = _add_client(total, local.params, global_state.params, cfg.clip_norm)
        std = 0.0
        if cfg.clip_norm is not None and cfg.noise_multiplier > 0:
            std = cfg.noise_multiplier * cfg.clip_norm / cfg.num_clients
        noise = jax.tree.map(lambda m, std=std: np.asarray(
            std * rng.standard_normal(m.shape) if std else np.zeros(m.shape), m.dtype), total)
        params, update_norm = _apply_mean(global_state.params, total, noise, cfg.num_clients)
        end = step + cfg.local_steps
        global_state = global_state.replace(
            params=params, step=jnp.asarray(end, jnp.asarray(global_state.step).dtype),
            opt_state=with_schedule_count(fresh_opt_state, end))
        history.append({"round": r + 1, "first_step": step,
                        "learning_rate": float(trainer.learning_rate_fn(step)),
                        "update_norm": float(update_norm),
                        "val_loss": evaluator.loss(params) if evaluator is not None else None})
    eps = epsilon(cfg)
    report = {"rounds": history, "epsilon": eps,
              "delta": cfg.target_delta if eps is not None else None,
              "config": dataclasses.asdict(cfg)}
    from capibara_exp.runtime import checkpoints

    if not checkpoints.all_finite(global_state.state_dict()):
        where = ", ".join(checkpoints.nonfinite_paths(global_state.state_dict()))
        raise ValueError(f"fedavg: the global state holds NaN/Inf after {cfg.rounds} rounds (in "
                         f"{where}); nothing written: lower the run's learning rate or set "
                         "fedavg.clip_norm")
    if out_dir is not None:

        out_dir = Path(out_dir).absolute()
        mgr = checkpoints.manager(out_dir)
        try:
            step = int(jax.device_get(global_state.step))
            checkpoints.save(mgr, step, global_state.state_dict(), kind="fedavg")
        finally:
            mgr.close()
        report["checkpoint"] = str(out_dir / f"{checkpoints.STEP_PREFIX}_{step}")
        (out_dir / REPORT).write_text(json.dumps(report, indent=1))
    return global_state, report
