"""LoRA and QLoRA fine-tuning on a frozen base model (the local engine's own feature).

gin binds `lora.LoraModel` (gin/models/lora.gin, conf/lora/); `capibara-exp-lora export`
merges a run's adapters into its base (export.py). The parts: which projections take
adapters (targets.py), the adapters in the network (adapters.py), the quantized base
(quantize.py), the base checkpoint and the pointer to it (base.py), the model (model.py).
"""

from capibara_exp.runtime.lora.model import LoraModel

__all__ = ["LoraModel"]
