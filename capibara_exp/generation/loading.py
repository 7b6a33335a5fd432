"""A checkpoint ready to decode: its network, parameters and vocabulary.

Any checkpoint in T5X's layout: a run's (either engine), a merge's, a LoRA export's or an
import's. Its model is found beside it as capibara-exp-convert export finds it (the run's
config.gin, an import's conf/model entry, the run a merge or a LoRA export came from) or
named with a conf/model entry; its parameters must fit that model, or nothing is decoded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from capibara_exp.base.errors import ConfigError
from capibara_exp.convert import hf_export
from capibara_exp.convert.hf_import import param_shapes
from capibara_exp.convert.network import network
from capibara_exp.data import vocabularies
from capibara_exp.runtime import checkpoints
from capibara_exp.runtime.lora import base as lora_base


@dataclasses.dataclass
class Loaded:
    model: dict  # the model group's keys
    module: Any  # nets.Decoder / nets.MoeDecoder
    params: Any  # the 'target' tree
    vocabulary: Any  # seqio.Vocabulary
    step_dir: Path


def model_keys(step_dir: Path, model_entry: str | None, config_dir: str | None) -> dict:
    model = (hf_export.compose_entry(model_entry, config_dir) if model_entry
             else hf_export.model_of_dir(step_dir.parent))
    if model is None:
        raise ConfigError(f"checkpoint={step_dir}: no model beside it; name it with "
                          "model=<conf/model entry> (and config_dir= for your own entries)")
    return dict(model)


def load(checkpoint: str | Path, model_entry: str | None = None,
         config_dir: str | None = None, dtype: str | None = None) -> Loaded:
    """The checkpoint's parameters restored for its model; a ConfigError naming the first
    parameter that does not fit, or a LoRA run's adapters-only checkpoint."""
    step_dir = hf_export.locate(checkpoint)
    if (step_dir / lora_base.POINTER).is_file():
        raise ConfigError(f"checkpoint={checkpoint}: a LoRA run's checkpoint holds adapters "
                          "only; export it first (capibara-exp-lora export)")
    model = model_keys(step_dir, model_entry, config_dir)
    if dtype:
        model["dtype"] = dtype
    vocabulary = vocabularies.get(model.get("vocabulary", "byte"), model.get("vocabulary_path"))
    vocabularies.check_fits(vocabulary, int(model["vocab_size"]))
    shapes = {k: jax.ShapeDtypeStruct(v, np.float32) for k, v in param_shapes(model).items()}
    checkpoints.check_params(step_dir, shapes, f"checkpoint={checkpoint}")
    flat = checkpoints.restore_params(step_dir, shapes)
    params = traverse_util.unflatten_dict(dict(flat), sep="/")
    return Loaded(model, network(model), params, vocabulary, step_dir)
