"""t5x.contrib.moe.models as engine=t5x binds it (`moe_models` in gin_bridge's t5x header):
MoeDecoderOnlyModel draws its decode_fn's samples per example as generation/t5x_models'
DecoderOnlyModel does; every other name is T5X's own."""

from __future__ import annotations

from typing import Any

from t5x.contrib.moe import models as _t5x_moe_models

from capibara_exp.generation.t5x_models import DrawsSamples


class MoeDecoderOnlyModel(DrawsSamples, _t5x_moe_models.MoeDecoderOnlyModel):
    """t5x.contrib.moe's MoeDecoderOnlyModel drawing the decode_fn's samples per example."""


def __getattr__(name: str) -> Any:
    return getattr(_t5x_moe_models, name)
