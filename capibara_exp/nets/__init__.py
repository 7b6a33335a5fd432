"""The project's Flax networks, with T5X's decoder-only call signature and logical axes."""

from capibara_exp.base.logical_axes import activation_axis_rules
from capibara_exp.nets.decoder import Decoder, DecoderConfig
from capibara_exp.nets.moe import MoeConfig, MoeDecoder

__all__ = ["activation_axis_rules", "Decoder", "DecoderConfig", "MoeConfig", "MoeDecoder"]
