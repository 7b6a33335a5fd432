"""QLoRA's frozen base: projection kernels quantized with qwix (google/qwix).

`lora.quantize_base` = nf4 (QLoRA's 4-bit NormalFloat), int4 or int8 quantizes every
projection kernel but the logits head and the routers (targets.quantizable): absmax scales,
one per `block_size` inputs of each output channel (null: one per output channel). The
network runs under qwix's post-training-quantization provider, which reads such a kernel as
a qwix QArray (values and scales) and dequantizes it inside the matmul. Scales are kept in
the network's compute dtype, so the dequantized kernel has the dtype the unquantized network
casts its kernel to, and a bfloat16 network stays bfloat16.

The provider's rule covers einsums only (the networks' projections are einsums), so the
adapters' own products (lax.dot_general, runtime/lora/adapters.py) are never quantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import linen as nn
from jax.sharding import PartitionSpec

NONE = "none"
QTYPES: dict[str, Any] = {"nf4": "nf4", "int4": jnp.int4, "int8": jnp.int8}
CHOICES = (NONE, *QTYPES)


def quantized_module(module: nn.Module, modules: Iterable[str], qtype: str,
                     block_size: int | None) -> nn.Module:
    """The network with the kernels of `modules` (module paths) read quantized."""
    rule = qwix.QuantizationRule(
        module_path="|".join(re.escape(m) for m in sorted(set(modules))),
        weight_qtype=QTYPES[qtype], tile_size=block_size, op_names=("einsum",))
    return qwix.quantize_model(module, qwix.PtqProvider([rule]))


def is_wrapped(x: Any) -> bool:
    """qwix's wrapper of a quantized parameter: its QArray and how it was quantized."""
    return isinstance(getattr(x, "array", None), qwix.QArray)


def is_quantized(x: Any) -> bool:
    return isinstance(x, qwix.QArray)


def quantize(w: jnp.ndarray, template: Any, stacked: int) -> qwix.QArray:
    """A kernel quantized as qwix's abstract init quantized it (`template`: the wrapper it
    made), per layer over `stacked` leading scan axes (qwix saw one layer's kernel)."""
    how = template.how

    def one(w_layer: jnp.ndarray) -> qwix.QArray:
        return qwix.quantize(w_layer, how.qtype, channelwise_axes=how.channelwise_axes,
                             tiled_axes=how.tiled_axes, calibration_method=how.calibration_method,
                             scale_dtype=template.array.scale.dtype)

    for _ in range(stacked):
        one = jax.vmap(one)
    return one(w)


def quantize_flat(params: Mapping[str, Any], templates: Mapping[str, Any],
                  stacked: Mapping[str, int]) -> dict[str, Any]:
    """Flat base params with the templated kernels quantized (QArrays), the rest as given."""
    return {k: quantize(v, templates[k], stacked[k]) if k in templates else v
            for k, v in params.items()}


def dequantize_flat(frozen: Mapping[str, Any], dtypes: Mapping[str, Any]) -> dict[str, Any]:
    """QArrays back to arrays of the base's dtypes (what the adapted network computed with)."""
    return {k: (qwix.dequantize(v) if is_quantized(v) else v).astype(dtypes[k])
            for k, v in frozen.items()}


def wrap(frozen: Mapping[str, Any], templates: Mapping[str, Any]) -> dict[str, Any]:
    """The params qwix's provider reads: each QArray in the wrapper its init made."""
    return {k: templates[k].replace(array=v) if k in templates else v for k, v in frozen.items()}


def frozen_axes(shapes: Mapping[str, Any], names: Mapping[str, tuple[str, ...]]
                ) -> dict[str, Any]:
    """Logical axes of the frozen base: a QArray's values take its kernel's axes, and its
    scales too except where a scale dimension is 1 (shared by the whole kernel dimension),
    so the quantized base shards like the unquantized one."""
    axes = {}
    for k, leaf in shapes.items():
        spec = PartitionSpec(*names[k])
        if is_quantized(leaf):
            scale = PartitionSpec(*(n if s != 1 else None
                                    for n, s in zip(names[k], leaf.scale.shape, strict=True)))
            zero = None if leaf.zero_point is None else scale
            spec = leaf.replace(qvalue=spec, scale=scale, zero_point=zero)
        axes[k] = spec
    return axes
