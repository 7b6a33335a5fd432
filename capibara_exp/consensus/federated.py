"""Federated consensus: FedAvg rounds over client shards of a task, optionally with DP.

Clients are simulated in one process. Each round every client starts from the global
parameters, takes a few local steps of the run's own trainer on its shard of the task
(seqio.ShardInfo), and sends back its parameter delta. With DP, each delta is clipped to
`clip_norm` and the average gets Gaussian noise of std noise_multiplier * clip_norm /
num_clients (DP-FedAvg, McMahan et al. 2018); epsilon comes from dp-accounting's RDP
accountant.
"""

from __future__ import annotations

import dataclasses
import json
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
    from capibara_exp.runtime.train_script import initial_state

    cfg = parts.train_dataset_cfg
    length = max(cfg.task_feature_lengths.values())
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    state, axes = initial_state(parts.model, init_rng, cfg.batch_size, length)
    trainer = parts.trainer_cls(model=parts.model, train_state=state, partitioner=parts.partitioner,
                                eval_names=[], summary_dir=None, train_state_axes=axes,
                                rng=dropout_rng)
    return trainer, jax.device_put(state, trainer.state_shardings)


def local_steps(trainer: Any, state: TrainState, batches: Iterator[dict], steps: int) -> TrainState:
    """`steps` real train steps of the run's trainer."""
    sharding = trainer.partitioner.data_sharding()
    for _ in range(steps):
        state, _ = trainer.train_step(state, jax.device_put(next(batches), sharding))
    return state


def clip(delta: Any, clip_norm: float) -> Any:
    """Scale a pytree to L2 norm at most clip_norm."""
    norm = optax.tree.norm(delta)
    return jax.tree.map(lambda d: d * jnp.minimum(1.0, clip_norm / (norm + 1e-12)), delta)


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
    """Run FedAvg; returns the global state and a report (loss per round, epsilon).

    With out_dir, the global state is written there as a T5X-layout checkpoint (with its
    manifest) beside fedavg_report.json.
    """
    trainer, global_state = build_trainer(parts, cfg.seed)
    streams = [client_batches(parts, c, cfg.num_clients) for c in range(cfg.num_clients)]
    rng = np.random.default_rng(cfg.seed)
    history = []
    for r in range(cfg.rounds):
        total = jax.tree.map(jnp.zeros_like, global_state.params)
        for c in range(cfg.num_clients):
            start = jax.tree.map(jnp.copy, global_state)  # the train step donates its input
            local = local_steps(trainer, start, streams[c], cfg.local_steps)
            delta = jax.tree.map(jnp.subtract, local.params, global_state.params)
            if cfg.clip_norm is not None:
                delta = clip(delta, cfg.clip_norm)
            total = jax.tree.map(jnp.add, total, delta)
        mean = jax.tree.map(lambda t: t / cfg.num_clients, total)
        if cfg.clip_norm is not None and cfg.noise_multiplier > 0:
            std = cfg.noise_multiplier * cfg.clip_norm / cfg.num_clients
            mean = jax.tree.map(lambda m: m + std * jnp.asarray(
                rng.standard_normal(m.shape), m.dtype), mean)
        params = jax.tree.map(jnp.add, global_state.params, mean)
        global_state = global_state.replace(params=params,
                                            step=global_state.step + cfg.local_steps)
        history.append({"round": r + 1,
                        "val_loss": evaluator.loss(params) if evaluator is not None else None})
    eps = epsilon(cfg)
    report = {"rounds": history, "epsilon": eps,
              "delta": cfg.target_delta if eps is not None else None,
              "config": dataclasses.asdict(cfg)}
    if out_dir is not None:
        from capibara_exp.runtime import checkpoints

        out_dir = Path(out_dir).absolute()
        mgr = checkpoints.manager(out_dir)
        try:
            step = int(jax.device_get(global_state.step))
            checkpoints.save(mgr, step, global_state.state_dict())
        finally:
            mgr.close()
        report["checkpoint"] = str(out_dir / f"{checkpoints.STEP_PREFIX}_{step}")
        (out_dir / REPORT).write_text(json.dumps(report, indent=1))
    return global_state, report
