"""The pieces of a run that merging needs (model, data sets, trainer), read from its config.gin.

A run's config.gin binds T5X's names; parsing it with a few extra bindings of `parts`
gives the same model, data sets and trainer the run trained with, on the local engine
(a config.gin rendered for engine=t5x gets the local header: the bodies are identical).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gin
from capibara_exp import gin_bridge
from capibara_exp.errors import ConfigError

CONFIG_GIN = "config.gin"
_PARTS_BINDINGS = """
consensus_run.parts:
  model = %MODEL
  train_dataset_cfg = @train/utils.DatasetConfig()
  eval_dataset_cfg = @train_eval/utils.DatasetConfig()
  partitioner = @partitioning.PjitPartitioner()
  trainer_cls = @trainer.Trainer
  eval_steps = %EVAL_STEPS
  random_seed = %RANDOM_SEED
"""


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a run was built from: its model, data sets, partitioner and trainer class."""

    model: Any
    train_dataset_cfg: Any
    eval_dataset_cfg: Any
    partitioner: Any
    trainer_cls: Any
    eval_steps: int
    random_seed: int | None


def parts(*, model: Any, train_dataset_cfg: Any, eval_dataset_cfg: Any, partitioner: Any,
          trainer_cls: Any, eval_steps: int, random_seed: int | None) -> RunParts:
    """Gin-bound constructor of RunParts (the configurable the extra bindings name)."""
    return RunParts(model, train_dataset_cfg, eval_dataset_cfg, partitioner, trainer_cls,
                    eval_steps, random_seed)


def find_config_gin(path: str | Path) -> Path:
    """config.gin of a run dir, model dir or checkpoint dir (searched upwards two levels)."""
    path = Path(path).absolute()
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / CONFIG_GIN).is_file():
            return candidate / CONFIG_GIN
    raise ConfigError(f"no {CONFIG_GIN} in {path} or the two dirs above it: merging evaluates "
                      "candidates with the model and data of the run that wrote them")


def local_gin_text(config_gin: Path) -> str:
    """The config.gin text with the local engine's header and the `parts` bindings."""
    text = config_gin.read_text()
    body = gin_bridge.body_of(text)
    extra = "from capibara_exp.consensus import run as consensus_run\n"
    return gin_bridge.header("local") + extra + body + _PARTS_BINDINGS


def load_parts(config_gin: str | Path) -> RunParts:
    """Parse a run's config.gin into gin's global config and build its parts."""
    from capibara_exp.runtime import gin_utils

    config_gin = Path(config_gin)
    gin_utils.parse(config_gin, local_gin_text(config_gin))
    return gin.get_configurable(parts)()
