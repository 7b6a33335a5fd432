"""Which projections of a network take LoRA adapters, and which a QLoRA base quantizes.

A projection is a matmul against a kernel: a Dense module's 2-D `kernel` (its path is the
module's, `layers_0/self_attention/query`) or one of the experts' 3-D kernels, 'expert'
first (`layers_1/mlp/expert/wi_0`). Targets are chosen by logical axis names (the presets
in conf/lora/: `[embed, joined_kv]` is every query, key and value) or by regular
expressions over projection paths; the scanned decoder's leading 'layers' axis is ignored,
so one preset serves scanned and unrolled layers alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from flax import traverse_util
from flax.linen import partitioning as nn_partitioning

from capibara_exp.base.errors import ConfigError

LAYERS_AXIS = "layers"  # nn.scan's stacking axis (nets.Decoder with scan_layers)
EXPERT_AXIS = "expert"
# Kernels a QLoRA base keeps in their own dtype: the logits head ('vocab') and the routers
# ('unmodeled'), whose small matmuls decide every token's softmax and expert.
UNQUANTIZED_AXES = frozenset({"vocab", "unmodeled"})
_WHERE = "lora.LoraModel"


@dataclasses.dataclass(frozen=True)
class Projection:
    """One matmul kernel of the network."""

    path: str  # the projection's name: the Dense module, or the expert kernel
    param: str  # the kernel's parameter path
    module: str  # the module whose method runs the matmul
    axes: tuple[str, ...]  # logical axes, the scanned 'layers' axis left out
    stacked: int  # leading 'layers' axes of the parameter (scanned layers)

    def describe(self) -> str:
        return f"{self.path} ({', '.join(self.axes)})"


def axis_names(params_axes: Mapping) -> dict[str, tuple[str, ...]]:
    """Parameter path -> logical axis names, from a 'params_axes' collection."""
    names = nn_partitioning.get_axis_names(dict(params_axes))
    return {k: tuple(v) for k, v in traverse_util.flatten_dict(names, sep="/").items()}


def stacked(names: tuple[str, ...]) -> int:
    """How many leading scanned 'layers' axes a parameter's axis names have."""
    return next((i for i, n in enumerate(names) if n != LAYERS_AXIS), len(names))


def projections(params_axes: Mapping) -> dict[str, Projection]:
    """The network's projections by path, from its 'params_axes' collection."""
    found = {}
    for param, names in axis_names(params_axes).items():
        stacked_axes = stacked(names)
        axes = names[stacked_axes:]
        parent, leaf = param.rsplit("/", 1) if "/" in param else ("", param)
        if leaf == "kernel" and len(axes) == 2:
            found[parent] = Projection(parent, param, parent, axes, stacked_axes)
        elif len(axes) == 3 and axes[0] == EXPERT_AXIS:
            found[param] = Projection(param, param, parent, axes, stacked_axes)
    return dict(sorted(found.items()))


def _listing(projs: Mapping[str, Projection]) -> str:
    return "; ".join(p.describe() for p in projs.values())


def _check_axes(target_axes: Sequence[Sequence[str]], params_axes: Mapping) -> set[tuple]:
    if isinstance(target_axes, str) or any(isinstance(t, str) for t in target_axes):
        raise ConfigError(f"{_WHERE}.target_axes must be a list of lists of logical axis names "
                          f"(e.g. [[embed, joined_kv]]), got {target_axes!r}")
    # A name neither this model nor the logical axis rules know is a typo; a known kind this
    # model lacks (experts, for a dense model under lora=all) just matches nothing.
    from capibara_exp.runtime.contrib_moe import standard_logical_axis_rules

    used = {n for names in axis_names(params_axes).values() for n in names}
    known = used | {name for name, _ in standard_logical_axis_rules()}
    unknown = sorted({n for t in target_axes for n in t} - known)
    if unknown:
        raise ConfigError(f"{_WHERE}.target_axes: {unknown} are not logical axis names (this "
                          f"model uses {sorted(used)}); projections: "
                          f"{_listing(projections(params_axes))}")
    return {tuple(t) for t in target_axes}


def select(params_axes: Mapping, target_axes: Sequence[Sequence[str]],
           target_modules: Sequence[str]) -> tuple[str, ...]:
    """Paths of the projections whose axes are one of target_axes or whose path fully
    matches one of target_modules. Every pattern must match, and the choice must not be
    empty: each error lists the model's projections."""
    projs = projections(params_axes)
    wanted = _check_axes(target_axes, params_axes)
    if isinstance(target_modules, str):
        raise ConfigError(f"{_WHERE}.target_modules must be a list of regular expressions, "
                          f"got the string {target_modules!r}")
    chosen = {p for p, proj in projs.items() if proj.axes in wanted}
    for pattern in target_modules:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"{_WHERE}.target_modules: {pattern!r} is not a regular "
                              f"expression ({err})") from None
        hits = {p for p in projs if regex.fullmatch(p)}
        if not hits:
            raise ConfigError(f"{_WHERE}.target_modules: {pattern!r} matches no projection "
                              f"path; this model's projections are: {_listing(projs)}")
        chosen |= hits
    if not chosen:
        raise ConfigError(f"{_WHERE}.target_axes={[list(t) for t in target_axes]} and "
                          f"target_modules={list(target_modules)} match no projection; this "
                          f"model's projections are: {_listing(projs)}")
    return tuple(sorted(chosen))


def quantizable(params_axes: Mapping) -> dict[str, Projection]:
    """The projections a QLoRA base quantizes: all but the logits head and the routers."""
    return {p: proj for p, proj in projections(params_axes).items()
            if not UNQUANTIZED_AXES & set(proj.axes)}
