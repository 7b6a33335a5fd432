"""Check a composed config before anything runs: unknown keys, missing values, types and
ranges (config_schema), and the rules that tie keys together. Each failure is a ConfigError
of one line naming the key, the file (or the command line) that set it, the value and
what is allowed.

Pure: the config and where its values came from (a Composition, which cli/compose.py builds
with Hydra) in, an error or nothing out.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import CONF_DIR, GIN_DIR, SWEEPS_ROOT
from capibara_exp.composing import config_schema

COMMAND_LINE = "the command line"


@dataclasses.dataclass
class Composition:
    """A composed config (with its `hydra` node) and the provenance of its values."""

    config_name: str
    cfg: DictConfig
    choices: dict[str, str | None]
    setters: dict[str, str]  # dotted key -> the file (or the command line) that set it last
    defaults: dict[str, Any]  # dotted key -> its value in the file that defines it
    search_dirs: list[Path]
    # Computes `setters` when a message first needs them (they cost another walk of the
    # defaults list, which a config without mistakes never pays).
    trace: Callable[[], dict[str, str]] | None = None
    cache_key: str | None = None  # its entry in cli/compose_cache.py, if it may be kept

    def setter(self, key: str) -> str:
        """Who set `key` (or its nearest parent)."""
        if self.trace is not None:
            self.setters, self.trace = {**self.trace(), **self.setters}, None
        parts = key.split(".")
        for end in range(len(parts), 0, -1):
            found = self.setters.get(".".join(parts[:end]))
            if found:
                return found
        return str(self.primary)

    @property
    def primary(self) -> Path:
        for root in self.search_dirs:
            if (root / f"{self.config_name}.yaml").is_file():
                return root / f"{self.config_name}.yaml"
        return self.search_dirs[0] / f"{self.config_name}.yaml"

    def option_file(self, group: str) -> str:
        choice = self.choices.get(group)
        for root in self.search_dirs:
            if choice and (root / group / f"{choice}.yaml").is_file():
                return str(root / group / f"{choice}.yaml")
        return f"{group}/"


def flatten(config_name: str, data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, down to leaves; a mapping whose rule is a map is one leaf."""
    out: dict[str, Any] = {}
    for key, value in (data or {}).items():
        name = f"{prefix}{key}"
        rule = config_schema.RULES_BY_CONFIG.get(config_name, {}).get(name)
        if isinstance(value, dict) and value and not (rule and rule.kind == "map"):
            out.update(flatten(config_name, value, name + "."))
        else:
            out[name] = value
    return out


def did_you_mean(name: str, candidates: Any) -> str:
    """"; did you mean 'x'?" for the closest candidate, or "". A dotted name is compared
    with the keys of its own group first (model.emb_dm -> model.emb_dim)."""
    candidates = sorted(set(candidates))
    if "." in name:
        group, last = name.rsplit(".", 1)
        peers = {c.rsplit(".", 1)[1]: c for c in candidates
                 if "." in c and c.rsplit(".", 1)[0] == group}
        close = difflib.get_close_matches(last, sorted(peers), n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{peers[close[0]]}'?"
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75 if "." in name else 0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def check(comp: Composition, missing_ok: bool = False) -> None:
    """Raise ConfigError (one line) for the first problem of the composed config.
    `missing_ok` (a config only shown, `--cfg job`): a mandatory value not given (`???`) is
    shown as Hydra shows it, not refused; the rules across keys then wait for the run."""
    from capibara_exp.composing import (
        cross_rules,  # (not for a command line refused while composing)
    )

    raw = OmegaConf.to_container(comp.cfg, resolve=False)
    raw.pop("hydra", None)
    keys = flatten(comp.config_name, raw)
    _check_unknown(comp, keys)
    missing = _check_missing(comp, keys, missing_ok)
    # a value without an interpolation is itself resolved: only the others are looked up
    values = {key: _resolved(comp, key) if _interpolated(value) else value
              for key, value in keys.items() if key not in missing}
    for key, value in values.items():
        rule = config_schema.rule_for(comp.config_name, key, comp.defaults.get(key))
        problem = rule.problem(value) if rule else None
        if problem:
            hint = did_you_mean(value, map(str, rule.choices)) if rule.choices and \
                isinstance(value, str) else ""
            raise ConfigError(f"{key}={cross_rules.show(value)} (set by {comp.setter(key)}): "
                              f"expected {problem}{hint}")
        if key.rsplit(".", 1)[-1] == "template" and value and not (GIN_DIR / value).is_file():
            raise ConfigError(f"{key}={value} (set by {comp.setter(key)}): no gin template "
                              f"gin/{value}")
    for rule_fn in () if missing else cross_rules.CROSS_RULES.get(comp.config_name, ()):
        found = rule_fn(values)
        if found:
            keys, message = found
            keys = (keys,) if isinstance(keys, str) else keys
            # name the key the command line set, if one was: that is what the user changed
            key = next((k for k in keys if comp.setter(k) == COMMAND_LINE), keys[0])
            shown = cross_rules.show(values.get(key))
            raise ConfigError(f"{key}={shown} (set by {comp.setter(key)}): {message}")


def _check_unknown(comp: Composition, keys: dict[str, Any]) -> None:
    groups = {g.split("/")[0] for g in comp.choices}
    for key in keys:
        if key in comp.defaults or key.split(".")[0] in ("hydra",):
            continue
        top = key.split(".")[0]
        known = [k for k in comp.defaults if k.split(".")[0] == top] if top in groups else \
            [k for k in comp.defaults if k.split(".")[0] not in groups] + _group_names(comp)
        hint = did_you_mean(key, known)
        if top in groups:
            raise ConfigError(f"unknown key '{key}': {comp.option_file(top)} has no such key "
                              f"(set by {comp.setter(key)}){hint}")
        raise ConfigError(f"unknown key '{key}' at the root: neither {comp.primary} nor a "
                          f"config group has it (set by {comp.setter(key)}){hint}")


def _group_names(comp: Composition) -> list[str]:
    """Every config group on the search path (a root key may be a misspelt one)."""
    return sorted({d.name for root in comp.search_dirs for d in group_dirs(root)})


def group_dirs(root: Path) -> list[Path]:
    """The config groups' directories under a search-path entry (the sweeps' root holds the
    group `sweeps` beside the rest of a checkout)."""
    if root == SWEEPS_ROOT and root != CONF_DIR:
        return [root / "sweeps"] if (root / "sweeps").is_dir() else []
    return [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(("_", "."))] \
        if root.is_dir() else []


def _check_missing(comp: Composition, keys: dict[str, Any], missing_ok: bool) -> set[str]:
    """The keys whose mandatory value is not given (an error unless `missing_ok`): `keys`
    holds the unresolved values, where OmegaConf's mark of a missing one is its text."""
    missing = set()
    for key, value in keys.items():
        if isinstance(value, str) and value == MISSING and \
                OmegaConf.is_missing(_parent(comp.cfg, key), key.rsplit(".", 1)[-1]):
            if not missing_ok:
                raise ConfigError(f"missing mandatory value (???) for: {key} (from "
                                  f"{comp.setter(key)}); give it on the command line: "
                                  f"{key}=...")
            missing.add(key)
    return missing


def _interpolated(value: Any) -> bool:
    """Whether an unresolved value (plain Python) holds an interpolation anywhere."""
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_interpolated(k) or _interpolated(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_interpolated(v) for v in value)
    return False


def _parent(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key.rsplit(".", 1)[0]) if "." in key else cfg


def _resolved(comp: Composition, key: str) -> Any:
    try:
        value = OmegaConf.select(comp.cfg, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{key} (set by {comp.setter(key)}): "
                          f"{str(err).splitlines()[0]}") from None
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
