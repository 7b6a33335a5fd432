"""The settings of federated rounds (`fedavg.*` in conf/merge.yaml), with Flower's names
where Flower has the setting: fraction_fit, min_fit_clients, proximal_mu (FedProx), eta,
beta_1, beta_2, tau (FedAdam, FedYogi), server_learning_rate, server_momentum (FedAvgM)."""

from __future__ import annotations

import dataclasses
import math

from capibara_exp.consensus.fedopt import ROUND_AGGREGATIONS, SERVER_OPTIMIZERS

POISONS = ("sign_flip", "scaled", "noise")  # simulated Byzantine clients' updates


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class FedConfig:
    num_clients: int = 4
    rounds: int = 3
    local_steps: int = 2
    fraction_fit: float = 1.0              # Flower: share of clients sampled per round
    min_fit_clients: int = 1               # Flower: the fewest sampled (Flower's default: 2)
    initial_checkpoint: str | None = None  # Flower's initial_parameters: a model or step dir
    proximal_mu: float = 0.0               # FedProx: mu/2 ||w - w_global||^2 in the clients' loss
    aggregation: str = "uniform"           # a registry method: uniform (FedAvg), median, ...
    num_byzantine: int = 0                 # its f (trimmed_mean, krum, ...)
    num_selected: int | None = None        # multi_krum
    server_optimizer: str | None = None    # fedadam | fedyogi | fedavgm (null: FedAvg's mean)
    eta: float | None = None               # FedAdam/FedYogi server learning rate (null: Flower's)
    beta_1: float | None = None
    beta_2: float | None = None
    tau: float | None = None
    server_learning_rate: float | None = None  # FedAvgM (null: Flower's 1.0)
    server_momentum: float | None = None       # FedAvgM (null: Flower's 0.0)
    clip_norm: float | None = None         # DP: per-client L2 clip of the update
    noise_multiplier: float = 0.0          # DP: noise std / clip_norm (on the sum)
    target_epsilon: float | None = None    # DP: solve noise_multiplier for this epsilon
    target_delta: float = 1e-5
    poisoned_clients: int = 0              # simulated Byzantine clients (the first ones)
    poison: str = "sign_flip"              # what they send: sign_flip | scaled | noise
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_clients", "rounds", "local_steps", "min_fit_clients"):
            self._require(name, _whole(getattr(self, name)) and getattr(self, name) >= 1,
                          "an integer >= 1")
        self._require("fraction_fit", _real(self.fraction_fit) and 0 < self.fraction_fit <= 1,
                      "in (0, 1]")
        self._require("min_fit_clients", self.min_fit_clients <= self.num_clients,
                      f"at most num_clients={self.num_clients}")
        self._require("proximal_mu", _real(self.proximal_mu) and self.proximal_mu >= 0,
                      "a finite number >= 0")
        self._require("aggregation", self.aggregation in ROUND_AGGREGATIONS,
                      f"one of {', '.join(ROUND_AGGREGATIONS)}")
        self._require("server_optimizer", self.server_optimizer in (None, *SERVER_OPTIMIZERS),
                      f"null or one of {', '.join(SERVER_OPTIMIZERS)}")
        for name in ("eta", "beta_1", "beta_2", "tau", "server_learning_rate",
                     "server_momentum"):
            value = getattr(self, name)
            if value is not None:
                reads = [o for o, hp in SERVER_OPTIMIZERS.items() if name in hp]
                self._require(name, self.server_optimizer in reads,
                              f"a setting of server_optimizer={' or '.join(reads)}, not of "
                              f"{self.server_optimizer}")
                self._require(name, _real(value) and value >= 0, "a finite number >= 0")
        self._require("clip_norm", self.clip_norm is None or (_real(self.clip_norm)
                                                              and self.clip_norm > 0),
                      "a finite number > 0 or null")
        self._require("noise_multiplier", _real(self.noise_multiplier)
                      and self.noise_multiplier >= 0, "a finite number >= 0")
        self._check_dp()
        self._require("num_byzantine", _whole(self.num_byzantine) and self.num_byzantine >= 0,
                      "an integer >= 0")
        self._require("poisoned_clients", _whole(self.poisoned_clients)
                      and 0 <= self.poisoned_clients <= self.num_clients,
                      f"an integer in [0, num_clients={self.num_clients}]")
        self._require("poison", self.poison in POISONS, f"one of {', '.join(POISONS)}")
        self._require("seed", _whole(self.seed), "an integer")

    def _check_dp(self) -> None:
        self._require("target_delta", _real(self.target_delta) and 0 < self.target_delta < 1,
                      "in (0, 1)")
        if self.target_epsilon is not None:
            self._require("target_epsilon", _real(self.target_epsilon)
                          and self.target_epsilon > 0, "a finite number > 0 or null")
            self._require("target_epsilon", self.clip_norm is not None,
                          "set together with fedavg.clip_norm (DP clips each client's update)")
            self._require("noise_multiplier", self.noise_multiplier == 0.0,
                          "left at 0 with target_epsilon (it is solved for)")
        if self.clip_norm is not None and (self.noise_multiplier > 0 or self.target_epsilon):
            self._require("aggregation", self.aggregation == "uniform",
                          "uniform with DP: the noise is calibrated for the mean of the clipped "
                          "updates")

    def _require(self, name: str, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"fedavg.{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def clients_per_round(self) -> int:
        from capibara_exp.consensus.fedopt import num_fit_clients

        return min(self.num_clients, num_fit_clients(self.num_clients, self.fraction_fit,
                                                     self.min_fit_clients))

    def server_hyperparams(self) -> dict[str, float]:
        """The server optimiser's settings: those given, Flower's defaults for the rest."""
        if self.server_optimizer is None:
            return {}
        defaults = SERVER_OPTIMIZERS[self.server_optimizer]
        return {k: (getattr(self, k) if getattr(self, k) is not None else v)
                for k, v in defaults.items()}
