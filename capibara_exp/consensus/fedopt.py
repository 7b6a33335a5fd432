"""A federated round's server side, as Flower users know it, in pure functions of pytrees:
client sampling (`fraction_fit`, `min_fit_clients`), the aggregation of the clients'
updates by any registry method (FedAvg's mean, FedMedian, FedTrimmedAvg, Krum, ...), and
the server optimisers of Reddi et al. 2021 with Flower's parameter names: FedAdam and
FedYogi (`eta`, `beta_1`, `beta_2`, `tau`) and FedAvgM (`server_learning_rate`,
`server_momentum`, Hsu et al. 2019). Trees here are dicts of host arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from capibara_exp.consensus import methods

# Flower's defaults for each server optimiser (flwr.server.strategy.FedAdam, ...).
SERVER_OPTIMIZERS: dict[str, dict[str, float]] = {
    "fedadam": {"eta": 1e-1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-9},
    "fedyogi": {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    "fedavgm": {"server_learning_rate": 1.0, "server_momentum": 0.0},
}
# Registry methods that aggregate the sampled clients' updates without a base or
# validation batches (Flower: FedAvg, FedMedian, FedTrimmedAvg, Krum).
ROUND_AGGREGATIONS = ("uniform", "median", "trimmed_mean", "krum", "multi_krum",
                      "geometric_median")


def num_fit_clients(num_clients: int, fraction_fit: float, min_fit_clients: int) -> int:
    """Flower's count of clients sampled for a round: max(int(N x fraction_fit), min)."""
    return max(int(num_clients * fraction_fit), min_fit_clients)


def sample_clients(rng: np.random.Generator, num_clients: int, count: int) -> list[int]:
    """`count` distinct clients, uniformly at random (Flower's ClientManager.sample)."""
    return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))


def aggregate(spec: Any, updates: Sequence[Any]) -> tuple[Any, np.ndarray | None]:
    """The clients' updates (trees) aggregated by a registry method; the weights each
    client got when the method gives weights (uniform, Krum, geometric median), else None."""
    leaves = [jax.tree.leaves(u) for u in updates]
    treedef = jax.tree.structure(updates[0])
    weights = None
    if spec.method in ("krum", "multi_krum", "geometric_median"):
        gram = np.zeros((len(updates),) * 2)
        for parts in zip(*leaves, strict=True):
            methods.gram_update(gram, [np.asarray(p) for p in parts])
        if spec.method == "geometric_median":
            weights = methods.geometric_median_weights(gram)
        else:
            n, f = len(updates), spec.num_byzantine
            k = 1 if spec.method == "krum" else (spec.num_selected or n - f)
            weights = methods.krum_weights(gram, f, k)
    elif spec.method == "uniform":
        weights = methods.uniform_weights(len(updates))
    merged = []
    for parts in zip(*leaves, strict=True):
        host = [np.array(p, np.float32) for p in parts]
        if weights is not None:
            merged.append(methods.weighted_mean(host, weights))
        elif spec.method == "median":
            merged.append(methods.median(host))
        else:
            merged.append(methods.trimmed_mean(host, spec.num_byzantine))
    return jax.tree.unflatten(treedef, merged), weights


@dataclasses.dataclass
class ServerState:
    """The server optimiser's moments (trees like the parameters), None before round 1."""

    m: Any = None
    v: Any = None
    momentum: Any = None


def server_step(name: str | None, hp: dict[str, float], state: ServerState, current: Any,
                aggregate_update: Any, server_round: int) -> Any:
    """The new global parameters from the current ones and the aggregated client update
    (the aggregate minus the current weights: Flower's delta_t). `server_round` from 1."""
    if name is None:  # FedAvg: the aggregate itself
        return jax.tree.map(np.add, current, aggregate_update)
    if name == "fedavgm":
        pseudo_gradient = jax.tree.map(np.negative, aggregate_update)
        if hp["server_momentum"] > 0.0:
            state.momentum = pseudo_gradient if state.momentum is None else jax.tree.map(
                lambda m, g: hp["server_momentum"] * m + g, state.momentum, pseudo_gradient)
            pseudo_gradient = state.momentum
        return jax.tree.map(lambda x, g: x - hp["server_learning_rate"] * g, current,
                            pseudo_gradient)
    b1, b2 = hp["beta_1"], hp["beta_2"]
    zeros = jax.tree.map(np.zeros_like, aggregate_update)
    state.m = jax.tree.map(lambda m, d: b1 * m + (1 - b1) * d, state.m or zeros,
                           aggregate_update)
    if name == "fedadam":
        state.v = jax.tree.map(lambda v, d: b2 * v + (1 - b2) * d * d, state.v or zeros,
                               aggregate_update)
        eta = hp["eta"] * np.sqrt(1 - b2 ** (server_round + 1.0)) / (1 - b1 ** (server_round + 1.0))
    else:  # fedyogi
        state.v = jax.tree.map(lambda v, d: v - (1 - b2) * d * d * np.sign(v - d * d),
                               state.v or zeros, aggregate_update)
        eta = hp["eta"]
    return jax.tree.map(lambda x, m, v: x + eta * m / (np.sqrt(v) + hp["tau"]), current, state.m,
                        state.v)
