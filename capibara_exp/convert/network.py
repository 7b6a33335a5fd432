"""The network a `model` group describes (the same fields gin binds), for the converter."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from capibara_exp.nets import Decoder, DecoderConfig, MoeConfig, MoeDecoder


def _fields(cls: type, keys: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in keys.items() if k in names}


def network(model: Mapping[str, Any]) -> Decoder:
    """nets.Decoder, or nets.MoeDecoder when the keys name experts."""
    config = DecoderConfig(**_fields(DecoderConfig, model))
    if model.get("num_experts"):
        return MoeDecoder(config, moe_config=MoeConfig(**_fields(MoeConfig, model)))
    return Decoder(config)
