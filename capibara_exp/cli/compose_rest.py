"""A command line that only sets values, on the composition kept for the rest of it.

Hydra composes a line in two steps: the defaults list, from the line's config group choices
(and its hydra.* overrides), and then each other override applied to that config in order.
An override `a.b=v` of a key of the app's config only takes part in the second step. So
where the rest of a line (its group choices and hydra.* overrides, nothing else) was kept
composed (compose_cache.py), the whole line's composition is that one with its values set
by Hydra's own code for the second step, and with the records Hydra makes of the line
(hydra.overrides.task, hydra.job.override_dirname) made again for the whole line: the config
Hydra composes, without Hydra's composition and plugin scan. `--cfg job seed=3` after
`--cfg job` (or any run of the plain line) costs about what the kept line costs.

A key the kept composition lacks is refused here, in the words Hydra's refusal gets.
Anything less certain is left to Hydra (returns None): a line whose rest sets or deletes
keys (`+k=v`, `~k`: their order against the values matters), a value Hydra's second step
refuses, a key under a value or an interpolation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType, ValueType
from omegaconf import DictConfig, OmegaConf

from capibara_exp.base.errors import ConfigError
from capibara_exp.cli import compose_cache


def from_kept_rest(config_name: str, given: list[str], dirs: list[Path], inputs: str,
                   unknown_key: Callable[[str], str]) -> DictConfig | None:
    """The composition of `given` (the overrides as Hydra gets them) from the kept
    composition of its rest, or None where Hydra must compose; ConfigError (unknown_key's
    line) for a key the config lacks. `inputs`: compose_cache.inputs(dirs)."""
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except Exception:  # noqa: BLE001 - Hydra says what is wrong with it
        return None
    values = [_sets_a_value(o, dirs) for o in parsed]
    plain = [o for o, value in zip(parsed, values, strict=True) if value]
    if not plain:
        return None
    rest = [o for o, value in zip(parsed, values, strict=True) if not value]
    if not all(_chooses(o, dirs) for o in rest):
        return None
    kept = compose_cache.load(compose_cache.key(config_name, [o.input_line for o in rest],
                                                dirs, False, inputs))
    if kept is None:
        return None
    from capibara_exp.base import private_apis

    for override in plain:  # in order, as Hydra applies them: its first refusal stands
        try:
            has = _has_key(kept, override.key_or_group)
        except Exception:  # noqa: BLE001 - a node this walk did not foresee: Hydra decides
            return None
        if has is False:
            raise ConfigError(unknown_key(override.key_or_group))
        if has is None:
            return None
        try:
            private_apis.apply_hydra_overrides([override], kept)
        except Exception:  # noqa: BLE001 - Hydra refuses it, in its own words
            return None
    return _recorded(kept, parsed)


def _has_key(cfg: DictConfig, dotted: str) -> bool | None:
    """Whether the config has the key; None where Hydra must decide (a mapping that takes
    new keys, a key under a value, an interpolation or a missing value `???`)."""
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in [*parents, leaf]:
        if part not in node.keys():  # a mapping that takes no new key refuses it
            return False if OmegaConf.is_struct(node) else None
        if part == leaf:
            return True
        if OmegaConf.is_interpolation(node, part) or OmegaConf.is_missing(node, part) \
                or not isinstance(node[part], DictConfig):
            return None  # not a plain mapping all the way: Hydra decides
        node = node[part]
    return True


def _recorded(cfg: DictConfig, parsed: list) -> DictConfig:
    """Hydra's records of the whole line, in its order (the kept config has the rest's)."""
    from capibara_exp.base import private_apis

    app = [o for o in parsed if not o.is_hydra_override()]
    job = cfg.hydra.job
    cfg.hydra.overrides.task = [o.input_line for o in app]
    job.override_dirname = private_apis.hydra_overrides_dirname(
        app, kv_sep=job.config.override_dirname.kv_sep,
        item_sep=job.config.override_dirname.item_sep,
        exclude_keys=job.config.override_dirname.exclude_keys)
    return cfg


def _sets_a_value(override: Any, dirs: list[Path]) -> bool:
    """`key=value` for a key of the app's config (not a group, hydra's, a sweep, + or ~)."""
    key = override.key_or_group
    return (override.type == OverrideType.CHANGE and override.value_type == ValueType.ELEMENT
            and override.package is None and "/" not in key
            and not key.split(".")[0] == "hydra" and not isinstance(override.value(), dict)
            and ("." in key or not _is_group(key, dirs)))


def _chooses(override: Any, dirs: list[Path]) -> bool:
    """An override of the defaults list (a group's option, added or removed) or of Hydra's
    own config: none of them changes the app's keys after the defaults list is composed."""
    key = override.key_or_group
    if key.split(".")[0] == "hydra" or key.startswith("hydra/"):
        return True
    return _is_group(key, dirs) and not isinstance(override.value(), dict)


def _is_group(key: str, dirs: list[Path]) -> bool:
    return any((root / key).is_dir() for root in dirs)
