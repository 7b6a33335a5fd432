"""Search spaces in Hydra's sweep syntax -> Optuna distributions.

`choice(a, b)` and `a,b` -> categorical; `range(start, stop[, step])` -> integers (Python
range: stop excluded) or, for floats, the categorical of the values it lists;
`interval(low, high)` -> float; `tag(log, interval(...))` -> log-uniform float;
`tag(int, interval(...))` -> integer (Hydra reads interval bounds as floats); anything
else is a fixed override passed to every trial.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import optuna.distributions as od
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

from capibara_exp.gin_bridge import ConfigError


@dataclass(frozen=True)
class SearchSpace:
    distributions: dict[str, od.BaseDistribution]
    fixed: tuple[str, ...]  # overrides applied to every trial, as Hydra strings

    def grid(self) -> dict[str, list]:
        """The search space as GridSampler's lists (discrete dimensions only)."""
        grid = {}
        for key, dist in self.distributions.items():
            if isinstance(dist, od.CategoricalDistribution):
                grid[key] = list(dist.choices)
            elif isinstance(dist, od.IntDistribution) and not dist.log:
                grid[key] = list(range(dist.low, dist.high + 1, dist.step))
            else:
                raise ConfigError(f"hydra.sweeper.params.{key}: the grid sampler needs a discrete "
                                  "dimension (choice or range), not an interval")
        return grid


def _range_values(sweep: RangeSweep) -> list:
    values, x = [], sweep.start
    step = sweep.step
    if step == 0:
        raise ConfigError("range(): step must not be 0")
    while (x < sweep.stop) if step > 0 else (x > sweep.stop):
        values.append(round(x, 12) if isinstance(x, float) else x)
        x += step
    return values


def distribution(key: str, sweep: object) -> od.BaseDistribution:
    """The Optuna distribution of one parsed sweep value."""
    if isinstance(sweep, ChoiceSweep):
        if "log" in sweep.tags:
            raise ConfigError(f"{key}: tag(log, ...) applies to interval or range, not choice")
        return od.CategoricalDistribution(sweep.list)
    if isinstance(sweep, RangeSweep):
        values = _range_values(sweep)
        if not values:
            raise ConfigError(f"{key}: {sweep} lists no values")
        all_int = all(isinstance(v, int) for v in (sweep.start, sweep.stop, sweep.step))
        if all_int and sweep.step > 0:
            return od.IntDistribution(values[0], values[-1], log="log" in sweep.tags,
                                      step=1 if "log" in sweep.tags else sweep.step)
        if "log" in sweep.tags:
            raise ConfigError(f"{key}: tag(log, range(...)) needs integer bounds and step")
        return od.CategoricalDistribution(values)
    if isinstance(sweep, IntervalSweep):
        low, high = sweep.start, sweep.end
        if not low < high:
            raise ConfigError(f"{key}: interval({low}, {high}) is empty")
        if "int" in sweep.tags:
            return od.IntDistribution(int(low), int(high), log="log" in sweep.tags)
        if "log" in sweep.tags and low <= 0:
            raise ConfigError(f"{key}: tag(log, interval({low}, {high})) needs a positive "
                              "lower bound")
        return od.FloatDistribution(float(low), float(high), log="log" in sweep.tags)
    raise ConfigError(f"{key}: unsupported sweep {sweep!r}")


def parse(overrides: Iterable[str]) -> SearchSpace:
    """Split `key=value` strings into distributions (sweeps) and fixed overrides."""
    parser = OverridesParser.create()
    distributions: dict[str, od.BaseDistribution] = {}
    fixed: list[str] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception as err:  # hydra's parser raises OverrideParseException and friends
            raise ConfigError(f"search space entry '{text}': {err}") from err
        key = override.get_key_element()
        if override.is_sweep_override():
            distributions[key] = distribution(key, override.value())
        else:
            fixed.append(f"{key}={override.get_value_element_as_str()}")
    return SearchSpace(distributions, tuple(fixed))


def to_override(key: str, value: object) -> str:
    """A sampled value as a Hydra override string."""
    if isinstance(value, str):
        if _needs_quotes(value):
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return f"{key}={value}"
    if isinstance(value, float):
        return f"{key}={value!r}"
    return f"{key}={value}"


def _needs_quotes(value: str) -> bool:
    return not value.replace("_", "").replace("-", "").replace(".", "").isalnum()
