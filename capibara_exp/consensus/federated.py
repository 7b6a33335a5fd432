"""Federated rounds over client shards of a task, as Flower users know them.

Clients are simulated in one process. Each round samples clients (Flower's fraction_fit
and min_fit_clients); each starts from the global parameters, takes a few local steps of
the run's own trainer on its shard of the task (seqio.ShardInfo), optionally with
FedProx's proximal term (consensus/fedprox.py), and sends back its parameter update. The
server aggregates the updates with a registry method (FedAvg's mean, or the median,
trimmed mean, Krum, ... against Byzantine clients) and applies them directly or through a
server optimiser (FedAdam, FedYogi, FedAvgM; consensus/fedopt.py). Rounds start from the
model's initialisation or from a checkpoint (Flower's initial_parameters). Clients keep no
optimizer state between rounds (fresh moments each round), while the learning-rate
schedule follows the global step, so warm-up and decay advance round by round.

With DP (DP-FedAvg, McMahan et al. 2018), each update is clipped to `clip_norm` and the
mean gets Gaussian noise of std noise_multiplier x clip_norm / clients per round; the
noise multiplier is given, or solved for a target epsilon (consensus/dp.py). A round
whose noise is larger than the update it hides is reported, and warned about.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from capibara_exp.consensus import dp, fedopt
from capibara_exp.consensus.fedconfig import FedConfig
from capibara_exp.consensus.run import RunParts
from capibara_exp.runtime.trainer import TrainState

REPORT = "fedavg_report.json"
__all__ = ["FedConfig", "fedavg"]


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


def build_trainer(parts: RunParts, seed: int, proximal_mu: float = 0.0
                  ) -> tuple[Any, TrainState]:
    """The run's trainer (compiled once) and its initial state; with proximal_mu > 0 the
    model carries FedProx's term (its anchor: `trainer.model.anchor`)."""
    from capibara_exp.consensus.fedprox import ProxModel
    from capibara_exp.runtime.state import initial_state, make_trainer

    cfg = parts.train_dataset_cfg
    length = max(cfg.task_feature_lengths.values())
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    state, axes = initial_state(parts.model, init_rng, cfg.batch_size, length)
    model = parts.model
    if proximal_mu > 0:
        model = ProxModel(model, proximal_mu, jax.eval_shape(lambda: state.params), axes.params)
        model.anchor = state.params
    trainer = make_trainer(parts.trainer_cls, model, parts.partitioner, state, axes,
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


@jax.jit
def _fresh_copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)  # the train step donates its input


def _norm(tree: Any) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64)))
                             for x in jax.tree.leaves(tree))))


def _poisoned(update: Any, kind: str, rng: np.random.Generator) -> Any:
    """A simulated Byzantine client's update."""
    if kind == "sign_flip":
        return jax.tree.map(lambda d: -10.0 * d, update)
    if kind == "scaled":
        return jax.tree.map(lambda d: 100.0 * d, update)
    return jax.tree.map(lambda d: rng.normal(0.0, 1.0, d.shape).astype(d.dtype), update)


def initial_parameters(cfg: FedConfig, state: TrainState) -> tuple[TrainState, list[dict]]:
    """The state the rounds start from: the model's initialisation, or the parameters (EMA
    weights for an EMA run) and step of `cfg.initial_checkpoint`; and their lineage."""
    from capibara_exp.consensus import store
    from capibara_exp.runtime import lineage

    if cfg.initial_checkpoint is None:
        return state, [lineage.init_ancestor(cfg.seed, state.params)]
    cand = store.candidate_from_path(cfg.initial_checkpoint, name="initial_checkpoint")
    with store.LeafReader() as reader:
        params = reader.read_subtree(cand, store.leaf_index(cand), ("target",))
    want = jax.tree.structure(state.params)
    if jax.tree.structure(params) != want or any(
            np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(params),
                                                       jax.tree.leaves(state.params),
                                                       strict=True)):
        raise ValueError(f"fedavg.initial_checkpoint: {cand.step_dir} was written by another "
                         "model (its parameters' tree differs from the run's)")
    params = jax.device_put(jax.tree.map(lambda p, s: np.asarray(p, s.dtype), params,
                                         state.params), jax.tree.map(lambda x: x.sharding,
                                                                     state.params))
    step = jnp.asarray(cand.step, jnp.asarray(state.step).dtype)
    return state.replace(params=params, step=step), lineage.descended_from(cand.step_dir)


def _noise_multiplier(cfg: FedConfig) -> float:
    if cfg.clip_norm is None:
        return 0.0
    if cfg.target_epsilon is not None:
        return dp.noise_for_epsilon(cfg.target_epsilon, cfg.clients_per_round / cfg.num_clients,
                                    cfg.rounds, cfg.target_delta)
    return cfg.noise_multiplier


def _client_updates(ctx: dict, round_start: TrainState, clients: list[int]) -> list[Any]:
    """Each sampled client's update (host arrays), clipped under DP; poisoned ones swapped."""
    cfg, trainer = ctx["cfg"], ctx["trainer"]
    updates = []
    start = jax.device_get(round_start.params)
    for c in clients:
        local = local_steps(trainer, _fresh_copy(round_start), ctx["streams"][c], cfg.local_steps)
        update = jax.tree.map(lambda a, b: np.asarray(a, np.float32) - np.asarray(b, np.float32),
                              jax.device_get(local.params), start)
        if c < cfg.poisoned_clients:
            update = _poisoned(update, cfg.poison, ctx["rng"])
        if cfg.clip_norm is not None:
            update = jax.device_get(clip(update, cfg.clip_norm))
        updates.append(update)
    return updates


def _round(ctx: dict, state: TrainState, r: int) -> tuple[TrainState, dict]:
    cfg, trainer = ctx["cfg"], ctx["trainer"]
    step = int(jax.device_get(state.step))
    round_start = state.replace(opt_state=with_schedule_count(ctx["fresh_opt"], step))
    if cfg.proximal_mu > 0:  # FedProx: the clients' anchor is this round's global model
        trainer.model.anchor = state.params
        trainer.reload_frozen()
    clients = fedopt.sample_clients(ctx["rng"], cfg.num_clients, cfg.clients_per_round)
    updates = _client_updates(ctx, round_start, clients)
    update, weights = fedopt.aggregate(ctx["spec"], updates)
    std = ctx["noise_multiplier"] * (cfg.clip_norm or 0.0) / len(clients)
    noise = jax.tree.map(lambda u: (std * ctx["rng"].standard_normal(u.shape)).astype(u.dtype),
                         update)
    signal_norm, noise_norm = _norm(update), _norm(noise) if std else 0.0
    current = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(state.params))
    new = fedopt.server_step(cfg.server_optimizer, cfg.server_hyperparams(), ctx["server"],
                             current, jax.tree.map(np.add, update, noise), r + 1)
    new = jax.device_put(jax.tree.map(lambda n, p: np.asarray(n, p.dtype), new, state.params),
                         jax.tree.map(lambda x: x.sharding, state.params))
    end = step + cfg.local_steps
    state = state.replace(params=new, step=jnp.asarray(end, jnp.asarray(state.step).dtype),
                          opt_state=with_schedule_count(ctx["fresh_opt"], end))
    return state, {"round": r + 1, "first_step": step, "clients": clients,
                   "learning_rate": float(trainer.learning_rate_fn(step)),
                   "update_norm": signal_norm, "noise_norm": noise_norm,
                   "client_weights": None if weights is None else [float(w) for w in weights],
                   "val_loss": ctx["evaluator"].loss(new) if ctx["evaluator"] else None}


def drowning_warnings(history: list[dict], start_loss: float | None) -> list[str]:
    """Rounds whose DP noise was larger than the aggregated update it was added to."""
    drowned = [h for h in history if h["noise_norm"] > h["update_norm"] > 0 or
               (h["noise_norm"] > 0 and h["update_norm"] == 0)]
    if not drowned:
        return []
    worst = max(drowned, key=lambda h: h["noise_norm"] / max(h["update_norm"], 1e-30))
    losses = [h["val_loss"] for h in history if h["val_loss"] is not None]
    trend = (f"; validation loss {start_loss:.4g} -> {losses[-1]:.4g}"
             if start_loss is not None and losses else "")
    return [f"warning: the DP noise drowns the update in {len(drowned)} of {len(history)} "
            f"rounds (round {worst['round']}: noise norm {worst['noise_norm']:.3g} vs update "
            f"norm {worst['update_norm']:.3g}){trend}: raise fedavg.clip_norm, sample more "
            "clients per round or allow a larger epsilon"]


def fedavg(parts: RunParts, cfg: FedConfig, evaluator: Any = None,
           out_dir: str | Path | None = None) -> tuple[TrainState, dict]:
    """Run the rounds; returns the global state and a report (per round: the clients
    sampled, the schedule's learning rate at its first local step, the norms of the
    aggregated update and of the DP noise, the validation loss; the noise multiplier and
    epsilon; warnings). With out_dir, the global state is written there as a T5X-layout
    checkpoint (with its manifest and lineage) beside fedavg_report.json."""
    from capibara_exp.composing.merge_methods import MergeSpec

    spec = MergeSpec(cfg.aggregation, num_byzantine=cfg.num_byzantine,
                     num_selected=cfg.num_selected)
    spec.check_candidates(cfg.clients_per_round, "clients per round")
    z = _noise_multiplier(cfg)
    trainer, state = build_trainer(parts, cfg.seed, cfg.proximal_mu)
    state, ancestors = initial_parameters(cfg, state)
    ctx = {"cfg": cfg, "trainer": trainer, "spec": spec, "noise_multiplier": z,
           "fresh_opt": state.opt_state, "rng": np.random.default_rng(cfg.seed),
           "server": fedopt.ServerState(), "evaluator": evaluator,
           "streams": [client_batches(parts, c, cfg.num_clients) for c in range(cfg.num_clients)]}
    start_loss = evaluator.loss(state.params) if evaluator is not None else None
    history = []
    for r in range(cfg.rounds):
        state, record = _round(ctx, state, r)
        history.append(record)
    q = cfg.clients_per_round / cfg.num_clients
    eps = dp.epsilon(z, q, cfg.rounds, cfg.target_delta) if z > 0 else None
    report = {"rounds": history, "start_val_loss": start_loss, "noise_multiplier": z or None,
              "sampling_rate": q, "epsilon": eps,
              "delta": cfg.target_delta if eps is not None else None,
              "warnings": drowning_warnings(history, start_loss),
              "config": dataclasses.asdict(cfg)}
    for line in report["warnings"]:
        print(f"capibara-exp fedavg: {line}", file=sys.stderr)
    _write(state, report, ancestors, out_dir)
    return state, report


def _write(state: TrainState, report: dict, ancestors: list[dict], out_dir: Any) -> None:
    from capibara_exp.runtime import checkpoints

    tree = state.state_dict()
    if not checkpoints.all_finite(tree):
        raise ValueError(f"fedavg: the global state holds NaN/Inf after {len(report['rounds'])} "
                         f"rounds (in {', '.join(checkpoints.nonfinite_paths(tree))}); nothing "
                         "written: lower the run's learning rate or set fedavg.clip_norm")
    if out_dir is None:
        return
    out_dir = Path(out_dir).absolute()
    mgr = checkpoints.manager(out_dir)
    try:
        step = int(jax.device_get(state.step))
        checkpoints.save(mgr, step, tree, kind="fedavg", lineage=ancestors)
    finally:
        mgr.close()
    report["checkpoint"] = str(out_dir / f"{checkpoints.STEP_PREFIX}_{step}")
    (out_dir / REPORT).write_text(json.dumps(report, indent=1))
