"""The pieces of a run that merging needs (model, data sets, partitioner, trainer), read from
its config.gin the way every caller reads them: train_script.train's own bindings
(`gin_utils.run_bindings`), so an MoE run merges with its MoE partitioner and trainer.
A config.gin rendered for engine=t5x gets the local header (the bodies are identical).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from capibara_exp.base.errors import ConfigError
from capibara_exp.composing import gin_bridge

CONFIG_GIN = "config.gin"


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a run was built from: its model, data sets, partitioner, trainer class and the
    local engine's trainer features (EMA, the skip policy)."""

    model: Any
    train_dataset_cfg: Any
    eval_dataset_cfg: Any
    partitioner: Any
    trainer_cls: Any
    eval_steps: int
    random_seed: int | None
    trainer_features: dict = dataclasses.field(default_factory=dict)


def parts_from_bindings(bindings: dict[str, Any]) -> RunParts:
    """RunParts from train_script.train's bindings (gin_utils.run_bindings)."""
    from capibara_exp.runtime.state import trainer_features

    return RunParts(bindings["model"], bindings["train_dataset_cfg"],
                    bindings.get("train_eval_dataset_cfg"), bindings["partitioner"],
                    bindings["trainer_cls"], bindings.get("eval_steps", 0),
                    bindings.get("random_seed"), trainer_features(bindings))


def find_config_gin(path: str | Path) -> Path:
    """config.gin of a run dir, model dir or checkpoint dir (searched upwards two levels)."""
    path = Path(path).absolute()
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / CONFIG_GIN).is_file():
            return candidate / CONFIG_GIN
    raise ConfigError(f"no {CONFIG_GIN} in {path} or the two dirs above it: merging evaluates "
                      "candidates with the model and data of the run that wrote them")


def local_gin_text(config_gin: Path) -> str:
    """The config.gin text with the local engine's header."""
    return gin_bridge.header("local") + gin_bridge.body_of(config_gin.read_text())


def load_parts(config_gin: str | Path) -> RunParts:
    """Parse a run's config.gin into gin's global config and build its parts."""
    from capibara_exp.runtime import gin_utils

    config_gin = Path(config_gin)
    return parts_from_bindings(gin_utils.run_bindings(config_gin, local_gin_text(config_gin)))
