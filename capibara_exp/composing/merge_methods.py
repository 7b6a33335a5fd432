"""The merge methods and their parameters, one table each: what a config may say.

`MergeSpec`'s fields are every merge parameter, each with its default, its meaning and its
check (field metadata); `METHODS` maps a method to its help, the parameters it reads,
whether it needs validation batches or a base, and the fewest candidates it can take.
Compose time reads them (the schema's checks, `capibara-exp-merge --help`), consensus/
binds each method to its solver (consensus/registry.py); conf/merge.yaml's keys, the
consensus action's `merge_params` and merge() itself all read these tables: a new
parameter is a field here and a key in conf/merge.yaml. Pure: the standard library only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _weights_ok(w: Any) -> str | None:
    if w is None:
        return None
    if isinstance(w, (str, Mapping)) or not all(_real(x) for x in w):
        return f"must be a list of finite numbers, got {w!r}"
    if any(x < 0 for x in w) or sum(w) <= 0:
        return f"must be a list of numbers >= 0 with a positive sum, got {list(w)!r}"
    return None


def _t_ok(t: Any) -> str | None:
    values = [t] if _real(t) else list(t) if isinstance(t, (list, tuple)) and t else None
    if values is None or not all(_real(x) and 0 <= x <= 1 for x in values):
        return f"must be a number in [0, 1] or a non-empty list of them (one per layer " \
               f"anchor), got {t!r}"
    return None


def _optional_bool(b: Any) -> str | None:
    return None if b is None or isinstance(b, bool) else f"must be true, false or null, got {b!r}"


def _param(default: Any, help: str, check: Callable[[Any], str | None]) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


@dataclasses.dataclass(frozen=True)
class MergeSpec:
    """A merge method and its parameters (conf/merge.yaml, the action's merge_params)."""

    method: str = "uniform"
    weights: Sequence[float] | None = _param(
        None, "one weight per candidate: finite, >= 0, positive sum (renormalised over those "
        "that pass the gate)", _weights_ok)
    num_byzantine: int = _param(
        0, "f, how many candidates may be bad: an integer >= 0; trimmed_mean trims f per side; "
        "median, trimmed_mean and geometric_median need n > 2f, krum and multi_krum n > 2f + 2",
        lambda f: None if _int(f) and f >= 0 else f"must be an integer >= 0, got {f!r}")
    num_selected: int | None = _param(
        None, "multi_krum: how many to average, an integer in [1, n - f] (null: n - f)",
        lambda k: None if k is None or (_int(k) and k >= 1) else
        f"must be an integer >= 1 or null, got {k!r}")
    scale: float = _param(1.0, "lambda on the summed task vectors: finite",
                          lambda s: None if _real(s) else f"must be a finite number, got {s!r}")
    density: float = _param(
        0.2, "share kept: of each whole task vector (ties), of each leaf (breadcrumbs), the "
        "keep probability (dare, della: its mean): in (0, 1]",
        lambda d: None if _real(d) and 0 < d <= 1 else f"must be in (0, 1], got {d!r}")
    gamma: float = _param(
        0.01, "breadcrumbs: share of each leaf's largest magnitudes dropped: in [0, 1)",
        lambda g: None if _real(g) and 0 <= g < 1 else f"must be in [0, 1), got {g!r}")
    epsilon: float = _param(
        0.15, "della: keep probabilities span density -/+ epsilon by magnitude rank; both ends "
        "in (0, 1)", lambda e: None if _real(e) and e >= 0 else f"must be a number >= 0, got {e!r}")
    normalize: bool | None = _param(
        None, "divide the summed task vectors by the weight that took part (null: the "
        "method's default, mergekit's: true for della)", _optional_bool)
    rescale: bool = _param(
        True, "dare, della: divide the kept entries by their keep probability",
        lambda b: None if isinstance(b, bool) else f"must be true or false, got {b!r}")
    seed: int = _param(
        0, "dare, della: seed of the random masks (per candidate name and leaf): an integer >= 0",
        lambda n: None if _int(n) and n >= 0 else f"must be an integer >= 0, got {n!r}")
    t: Any = _param(
        0.5, "slerp: the interpolation factor (0: the first candidate), or a list of anchors "
        "spread over the layers (mergekit's gradient), each in [0, 1]", _t_ok)
    learn_steps: int = _param(
        10, "optimiser steps on the weights: an integer >= 1",
        lambda n: None if _int(n) and n >= 1 else f"must be an integer >= 1, got {n!r}")
    learn_rate: float = _param(
        0.05, "Adam's learning rate on the weight logits: finite, > 0",
        lambda r: None if _real(r) and r > 0 else f"must be a finite number > 0, got {r!r}")
    per_layer: bool = _param(
        True, "one weight per candidate and layer (false: one per candidate)",
        lambda b: None if isinstance(b, bool) else f"must be true or false, got {b!r}")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: unknown merge method {self.method!r} (choose from "
                             f"{', '.join(METHODS)})")
        for name in ("weights", "t"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        if self.method == "weighted" and self.weights is None:
            raise ValueError("weights: method=weighted needs one weight per candidate, got null")
        used = METHODS[self.method].params
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            problem = field.metadata["check"](value)
            if problem:
                raise ValueError(f"{field.name}: {problem}")
            if field.name not in used and value != field.default:
                raise ValueError(f"{field.name}={value!r} is not a parameter of method="
                                 f"{self.method} (its parameters: {', '.join(used) or 'none'})")
        if "epsilon" in used and not 0 < self.density - self.epsilon < self.density + \
                self.epsilon < 1:
            raise ValueError(f"epsilon: density -/+ epsilon must lie in (0, 1), got density="
                             f"{self.density}, epsilon={self.epsilon}")

    def check_candidates(self, n: int, what: str = "candidates") -> None:
        """The method's bounds for n candidates, as errors (never clamped)."""
        m, f = METHODS[self.method], self.num_byzantine
        if n < m.min_candidates(self):
            raise ValueError(f"method={self.method} with num_byzantine={f} needs at least "
                             f"{m.min_candidates(self)} {what} ({m.bound}), got {n}")
        if m.max_candidates is not None and n > m.max_candidates:
            raise ValueError(f"method={self.method} merges exactly {m.max_candidates} {what}, "
                             f"got {n}")
        if self.weights is not None and len(self.weights) != n and what == "candidates":
            raise ValueError(f"weights: method=weighted needs one weight per candidate ({n}), "
                             f"got {len(self.weights)}")
        if self.num_selected is not None and self.num_selected > n - f:
            raise ValueError(f"num_selected={self.num_selected} must be in [1, n - f] = "
                             f"[1, {n - f}] for {n} {what}")


def spec_from(method: str, params: Mapping[str, Any]) -> MergeSpec:
    """A MergeSpec from a method and a mapping of parameters; unknown names are errors."""
    known = param_names()
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"merge parameter {unknown[0]!r} is not one of {', '.join(known)}")
    return MergeSpec(method=method, **dict(params))


def param_names() -> list[str]:
    return [f.name for f in dataclasses.fields(MergeSpec)[1:]]


def param_checks() -> dict[str, Callable[[Any], str | None]]:
    """{parameter: its check, which returns the problem in words or None} (the conf schema
    checks merge.yaml's keys and consensus.merge_params with these at compose time)."""
    return {f.name: f.metadata["check"] for f in dataclasses.fields(MergeSpec)[1:]}


_TV_COMMON = ("weights", "density", "scale", "normalize")
_TV_PARAMS = {"dare": (*_TV_COMMON, "rescale", "seed"), "breadcrumbs": (*_TV_COMMON, "gamma"),
              "della": (*_TV_COMMON, "epsilon", "rescale", "seed")}


@dataclasses.dataclass(frozen=True)
class Method:
    """One merge method as configs see it: what it is, what it reads, its bounds (how it
    runs is consensus/registry.py's)."""

    help: str
    params: tuple[str, ...] = ()
    needs_validation: bool = False
    needs_base: bool = False
    needs_gram: bool = False  # the solver works on the candidates' Gram matrix
    min_candidates: Callable[[MergeSpec], int] = lambda spec: 1
    bound: str = ""
    max_candidates: int | None = None
    # A soup of unrelated models is refused: the candidates must share an ancestor (the
    # lineage in their manifests, or their weights' distance). Robust aggregators are
    # meant for replicas, some of which may be anything: they need none.
    shared_ancestor: bool = True


METHODS: dict[str, Method] = {
    "uniform": Method("the mean of the candidates"),
    "weighted": Method("sum_i w_i x_i with the given weights", ("weights",)),
    "greedy_soup": Method("Wortsman et al.: best first, add a candidate only if the "
                          "validation loss drops", needs_validation=True),
    "learned": Method("softmax weights per candidate (and layer) fitted to the validation "
                      "loss", ("learn_steps", "learn_rate", "per_layer"),
                      needs_validation=True),
    "median": Method("the coordinate-wise median (breakdown point 1/2)", ("num_byzantine",),
                     min_candidates=lambda s: 2 * s.num_byzantine + 1, bound="n > 2f",
                     shared_ancestor=False),
    "trimmed_mean": Method("the coordinate-wise mean without the f largest and smallest",
                           ("num_byzantine",), shared_ancestor=False,
                           min_candidates=lambda s: 2 * s.num_byzantine + 1, bound="n > 2f"),
    "krum": Method("Blanchard et al.: the candidate closest to its n - f - 2 neighbours",
                   ("num_byzantine",), needs_gram=True, shared_ancestor=False,
                   min_candidates=lambda s: 2 * s.num_byzantine + 3, bound="n > 2f + 2"),
    "multi_krum": Method("the mean of the num_selected best Krum scores",
                         ("num_byzantine", "num_selected"), needs_gram=True,
                         min_candidates=lambda s: 2 * s.num_byzantine + 3, bound="n > 2f + 2",
                         shared_ancestor=False),
    "geometric_median": Method("Weiszfeld's geometric median (breakdown point 1/2)",
                               ("num_byzantine",), needs_gram=True,
                               min_candidates=lambda s: 2 * s.num_byzantine + 1,
                               bound="n > 2f", shared_ancestor=False),
    "task_arithmetic": Method("base + scale * sum_i (x_i - base) (base=...)", ("scale",),
                              needs_base=True),
    "ties": Method("TIES-merging: trim each task vector to `density`, elect signs, average "
                   "(base=...)", ("scale", "density"), needs_base=True),
    "slerp": Method("spherical interpolation of two candidates at t (per layer with a list)",
                    ("t",), min_candidates=lambda s: 2,
                    bound="two candidates", max_candidates=2),
    "model_stock": Method("Jang et al.: per leaf, toward the mean by the offsets' angle to the "
                          "base (base=...)", needs_base=True,
                          min_candidates=lambda s: 2, bound="n >= 2"),
    **{name: Method(help, _TV_PARAMS[kind], needs_base=True)
       for name, (help, kind) in {
           "dare_ties": ("DARE: drop at random, keep `density`, rescale; TIES sign election "
                         "(base=...)", "dare"),
           "dare_linear": ("DARE: drop at random, keep `density`, rescale; weighted sum "
                           "(base=...)", "dare"),
           "breadcrumbs": ("Model Breadcrumbs: drop the largest `gamma` and the smallest, "
                           "keep `density`; weighted sum (base=...)", "breadcrumbs"),
           "breadcrumbs_ties": ("Model Breadcrumbs with TIES sign election (base=...)",
                                "breadcrumbs"),
           "della": ("DELLA: magnitude-ranked keep probabilities density -/+ epsilon, "
                     "rescale; TIES sign election (base=...)", "della"),
           "della_linear": ("DELLA with a weighted sum (base=...)", "della"),
       }.items()},
}


def help_text() -> str:
    """The methods and parameters, for `capibara-exp-merge --help`."""
    lines = ["Methods (method=...):"]
    for name, m in METHODS.items():
        extra = [f"params: {', '.join(m.params)}"] if m.params else []
        extra += ["needs validation batches"] if m.needs_validation else []
        extra += ["needs base="] if m.needs_base else []
        extra += [m.bound] if m.bound else []
        lines.append(f"  {name:17s}{m.help}" + (f" [{'; '.join(extra)}]" if extra else ""))
    lines.append("  fedavg           FedAvg rounds on one run's model and task (fedavg.*)")
    lines.append("Parameters (key=value; default):")
    for field in dataclasses.fields(MergeSpec)[1:]:
        lines.append(f"  {field.name} ({field.default!r}): {field.metadata['help']}")
    return "\n".join(lines)
