"""What a sweep is told (hydra.sweeper.*) and the keys its trials carry: the one module that
the driver (study.py), its helpers and a trial's pruning action (pruning.py, inside the
job) all read, so none of them imports the driver for a name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capibara_exp.base.errors import ConfigError

SAMPLER_KEY, PRUNER_KEY = "hydra.sweeper.sampler", "hydra.sweeper.pruner"  # named in errors

# A trial's user attributes and its job's overrides.
PRUNED_AT = "pruned_at_step"  # set on the trial by its job's pruning action
RUN_DIR = "run_dir"  # where a trial's job ran: its retry resumes there
PRUNER_OPTIONS = "pruner_options"  # a trial's job rebuilds its sweep's pruner with these
CACHE_KEY = "compilation_cache_dir"
SUBDIR_KEY = "hydra.sweep.subdir"  # the job's run dir under the sweep dir
STORAGE_ENV = "CAPIBARA_SWEEP_STORAGE"


@dataclass
class SweepSettings:
    """hydra.sweeper.* of conf/hydra/sweeper/capibara_optuna.yaml."""

    study_name: str
    storage: str | None = None
    direction: str | list[str] = "minimize"
    metric: str | list[str] = "loss"
    sampler: str = "tpe"
    seed: int | None = None
    n_trials: int = 8
    max_failure_rate: float = 0.5
    pruner: str = "none"
    n_workers: int = 1
    compile_cache: bool = True  # trials share XLA's compilation cache in the sweep dir
    worker_index: int = 0  # set on the processes a sweep starts; 0 is the one you started
    params: dict[str, str] = field(default_factory=dict)
    # More keywords of the Optuna sampler and pruner. null in the YAML (a {} there would be
    # a struct node that refuses `hydra.sweeper.pruner_options={n_warmup_steps: 40}`).
    sampler_options: dict[str, Any] | None = None
    pruner_options: dict[str, Any] | None = None
    heartbeat_interval: int | None = None  # None: HEARTBEAT_S on non-SQLite RDB; 0: off
    grace_period: int | None = None  # None: twice the heartbeat interval
    max_retries: int = 2  # runs again of a trial whose machine died or that was preempted
    storage_retry_s: float = 600.0  # how long a worker waits for a database that is away

    @property
    def directions(self) -> list[str]:
        return [self.direction] if isinstance(self.direction, str) else list(self.direction)

    @property
    def metrics(self) -> list[str]:
        return [self.metric] if isinstance(self.metric, str) else list(self.metric)

    def __post_init__(self) -> None:
        self.sampler_options = dict(self.sampler_options or {})
        self.pruner_options = dict(self.pruner_options or {})
        if len(self.directions) != len(self.metrics):
            raise ConfigError(f"hydra.sweeper: {len(self.directions)} direction(s) but "
                              f"{len(self.metrics)} metric(s); give one direction per metric")
        if self.n_workers < 1:
            raise ConfigError(f"hydra.sweeper.n_workers must be >= 1, got {self.n_workers}")
        if self.n_trials < 1:
            raise ConfigError(f"hydra.sweeper.n_trials must be >= 1, got {self.n_trials}")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ConfigError("hydra.sweeper.max_failure_rate must be in [0, 1], "
                              f"got {self.max_failure_rate}")
        if self.heartbeat_interval is not None and self.heartbeat_interval < 0:
            raise ConfigError("hydra.sweeper.heartbeat_interval must be >= 0 (0: off) or null, "
                              f"got {self.heartbeat_interval}")
        if self.grace_period is not None and self.grace_period < 1:
            raise ConfigError("hydra.sweeper.grace_period must be >= 1 or null, "
                              f"got {self.grace_period}")
        if self.max_retries < 0:
            raise ConfigError(f"hydra.sweeper.max_retries must be >= 0, got {self.max_retries}")
        if self.storage_retry_s < 0:
            raise ConfigError("hydra.sweeper.storage_retry_s must be >= 0, "
                              f"got {self.storage_retry_s}")
