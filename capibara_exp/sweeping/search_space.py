"""Search spaces in Hydra's sweep syntax -> Optuna distributions.

`choice(a, b)` and `a,b` -> categorical; `range(start, stop[, step])` -> integers (Hydra's
range, like Python's, excludes stop) or, for floats, the categorical of the values it lists;
`interval(low, high)` -> float (Hydra reads interval bounds as floats);
`int(interval(low, high))` or `tag(int, interval(...))` -> integer; `tag(log, ...)` of an
interval or an integer range -> log-scaled. Anything else is a fixed override passed to
every trial. When a key appears twice (a shipped sweep's params, then the command line),
the later entry wins, so a fixed value on the command line drops that key's search.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import optuna.distributions as od
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

from capibara_exp.base import overrides
from capibara_exp.base.errors import ConfigError


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


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        all_int = all(_is_int(v) for v in (sweep.start, sweep.stop, sweep.step))
        if "log" in sweep.tags:
            if not all_int or sweep.step != 1:
                # Optuna's log-scaled integers have step 1; dropping another step would
                # sample values the range does not list.
                raise ConfigError(f"{key}: tag(log, range(...)) needs integer bounds and step 1 "
                                  f"(got {sweep}); use tag(log, range(start, stop)) or "
                                  "choice(...) of the values")
            if values[0] < 1:
                raise ConfigError(f"{key}: tag(log, range(...)) needs a start >= 1 (got {sweep})")
            return od.IntDistribution(values[0], values[-1], log=True)
        if all_int and sweep.step > 0:
            return od.IntDistribution(values[0], values[-1], step=sweep.step)
        return od.CategoricalDistribution(values)
    if isinstance(sweep, IntervalSweep):
        low, high, log = sweep.start, sweep.end, "log" in sweep.tags
        if not low < high:
            raise ConfigError(f"{key}: interval({low}, {high}) is empty")
        if log and low <= 0:
            raise ConfigError(f"{key}: tag(log, interval({low}, {high})) needs a positive "
                              "lower bound")
        # int(interval(...)) gives int bounds (Hydra's cast); tag(int, ...) gives whole floats.
        if "int" in sweep.tags or (_is_int(low) and _is_int(high)):
            if not (float(low).is_integer() and float(high).is_integer()):
                raise ConfigError(f"{key}: an integer interval needs whole bounds, got "
                                  f"interval({low}, {high})")
            return od.IntDistribution(int(low), int(high), log=log)
        return od.FloatDistribution(float(low), float(high), log=log)
    raise ConfigError(f"{key}: unsupported sweep {sweep!r}")


def parse(overrides: Iterable[str]) -> SearchSpace:
    """Split `key=value` strings into distributions (sweeps) and fixed overrides; for a key
    given more than once, the last entry wins (the command line over a sweep's params)."""
    parser = OverridesParser.create()
    entries: dict[str, tuple[str, od.BaseDistribution | str]] = {}
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception as err:  # hydra's parser raises OverrideParseException and friends
            raise ConfigError(f"search space entry '{text}': {err}") from err
        key = override.get_key_element()
        name = key.lstrip("+~")
        entries.pop(name, None)  # a later entry moves to the end: Hydra applies it last
        if override.is_sweep_override():
            entries[name] = (key, distribution(key, override.value()))
        else:
            entries[name] = (key, text.strip())
    distributions = {k: v for k, v in entries.values() if not isinstance(v, str)}
    fixed = tuple(v for _, v in entries.values() if isinstance(v, str))
    return SearchSpace(distributions, fixed)


def to_override(key: str, value: object) -> str:
    """A sampled value as a Hydra override string."""
    return overrides.override(key, value)
