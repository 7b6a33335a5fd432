"""Compose a command line as Hydra will, before Hydra starts the job (and makes its run dir).

`compose` returns the composed config with where each value came from (the YAML file or the
command line), so that config_check can name the file of a bad value; a composition Hydra
refuses (a key typo, an option that does not exist, an unparsable override, malformed YAML
in a file the command uses) becomes one ConfigError line, with a "did you mean" from the
keys and options the config has.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import setup_globals
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import CONF_DIR, SWEEPS_ROOT
from capibara_exp.base.private_apis import interpolations_checked_once, libyaml_for_omegaconf
from capibara_exp.cli import compose_cache, compose_rest, parsed_cache
from capibara_exp.composing.config_check import (
    COMMAND_LINE,
    Composition,
    did_you_mean,
    flatten,
    group_dirs,
)


def search_dirs(extra: list[Path]) -> list[Path]:
    """Where config files are looked up, in Hydra's order: `--config-dir`s, conf/, sweeps/."""
    return [*(Path(d).absolute() for d in extra), CONF_DIR, SWEEPS_ROOT]


def compose(config_name: str, overrides: list[str], extra_dirs: list[Path],
            multirun: bool = False, cached: bool = False) -> Composition:
    """The config Hydra will compose for this command line; ConfigError if it cannot.
    `cached`: reuse the composition an earlier command kept for the same inputs
    (compose_cache.py; the caller keeps one with `keep` once its checks pass)."""
    dirs = search_dirs(extra_dirs)
    for d in dirs[: len(extra_dirs)]:
        if not d.is_dir():
            raise ConfigError(f"--config-dir {d}: no such directory")
    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    given = _with_search_path(overrides, dirs[: len(extra_dirs)])
    inputs = compose_cache.inputs(dirs) if cached and compose_cache.enabled() else None
    key = compose_cache.key(config_name, given, dirs, multirun, inputs) if inputs else None
    cfg = compose_cache.load(key) if key else None
    if key and cfg is None and not multirun:  # perhaps a line that only sets values more
        cfg = compose_rest.from_kept_rest(
            config_name, given, dirs, inputs, lambda k: _unknown_key(k, config_name, dirs))
    if cfg is None:
        cfg = _hydra_compose(config_name, given, mode, overrides, dirs)
    else:  # the resolvers Hydra registers when it starts (${now:...}, ${hydra:...})
        setup_globals()
    choices = dict(cfg.hydra.runtime.choices)

    def trace() -> dict[str, str]:  # only for messages: it walks Hydra's defaults list again
        with _reading():
            loader = GlobalHydra.instance().config_loader()
            defaults = loader.compute_defaults_list(config_name, given, mode).defaults
        return _setters(config_name, choices, defaults, overrides, dirs)

    return Composition(config_name, cfg, choices, {}, definitions(config_name, choices, dirs),
                       dirs, trace, key)


def keep(comp: Composition) -> None:
    """Keep a composition (one made with `cached`) for the next command with its inputs."""
    if comp.cache_key:
        compose_cache.store(comp.cache_key, comp.cfg)
    parsed_cache.keep()  # and the config files it read afresh


def _hydra_compose(config_name: str, given: list[str], mode: RunMode, overrides: list[str],
                   dirs: list[Path]) -> DictConfig:
    with _reading():
        loader = GlobalHydra.instance().config_loader()
        try:
            return loader.load_configuration(config_name, given, mode, from_shell=True)
        except (ConfigCompositionException, OverrideParseException, OmegaConfBaseException,
                yaml.YAMLError) as err:
            raise ConfigError(_composition_error(err, config_name, dirs)) from None
        except RecursionError:
            raise ConfigError("the defaults lists include each other without end (a config "
                              "that includes itself, directly or through others)") from None
        except (ValueError, TypeError, OSError, UnicodeError) as err:
            # Hydra's own refusals of the command line (`engine=null`: "Config group override
            # must be a string or a list"; a 5,000-digit integer; a key too long for a
            # file name) and unreadable config files: what the user typed or wrote.
            raise ConfigError(_bad_group_value(overrides, dirs) or _odd_input(err)) from None


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """Hydra set up to compose from conf/, its files read with libyaml and reused by their
    contents (parsed_cache.py), each interpolation's syntax checked once."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"), libyaml_for_omegaconf(), \
            parsed_cache.reused(), interpolations_checked_once():
        yield


def _with_search_path(overrides: list[str], extra: list[Path]) -> list[str]:
    """What `--config-dir` adds, as an override of hydra.searchpath (which conf/config.yaml
    sets to the sweeps' root: keep it)."""
    if not extra:
        return list(overrides)
    paths = ",".join(f"file://{p}" for p in [SWEEPS_ROOT, *extra])
    return [f"hydra.searchpath=[{paths}]", *overrides]


def definitions(config_name: str, choices: dict[str, str | None],
                dirs: list[Path]) -> dict[str, Any]:
    """Dotted key -> its value in the file that defines it: the primary config's own keys,
    and each chosen group option's (with the options it builds on: `defaults: [dense_tiny]`)."""
    groups = {g for g in choices if not g.startswith("hydra")}
    primary = _find(config_name, dirs)
    data = {k: v for k, v in _yaml(primary).items() if k not in ("defaults", "hydra")} \
        if primary else {}
    out = {k: v for k, v in flatten(config_name, data).items() if k.split(".")[0] not in groups}
    for group in sorted(groups):
        if choices[group] is None or "/" in group:
            continue
        for file in _option_chain(group, choices[group], dirs):
            data = {k: v for k, v in _yaml(file).items() if k not in ("defaults", "hydra")}
            if "@package _global_" not in file.read_text():
                data = {group: data}
            out.update({k: v for k, v in flatten(config_name, data).items()
                        if k.split(".")[0] == group})
    return out


def _option_chain(group: str, choice: str, dirs: list[Path],
                  seen: tuple[str, ...] = ()) -> list[Path]:
    """The files an option is made of, in merge order: the options of its own group that its
    defaults list names, then itself (where `_self_` is, else last)."""
    file = _find(f"{group}/{choice}", dirs)
    if file is None or choice in seen:
        return []
    chain: list[Path] = []
    for entry in _yaml(file).get("defaults") or []:
        if entry == "_self_":
            chain.append(file)
        elif isinstance(entry, str) and "/" not in entry and ":" not in entry:
            chain += _option_chain(group, entry, dirs, (*seen, choice))
    return chain if file in chain else [*chain, file]


def _yaml(path: Path) -> dict:
    stat = path.stat()
    return _load_yaml(str(path), stat.st_mtime_ns, stat.st_size)


# libyaml's parser where PyYAML has it (the same safe loading, several times faster: these
# files are read on every command, --help included)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=512)
def _load_yaml(path: str, mtime_ns: int, size: int) -> dict:
    del mtime_ns, size  # the cache key: a changed file is read again
    data = Path(path).read_bytes()
    try:
        loaded = yaml.load(data.decode("utf-8"), Loader=_SAFE_LOADER)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a YAML file (not UTF-8 text: byte {err.start})") \
            from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    return loaded if isinstance(loaded, dict) else {}


def _setters(config_name: str, choices: dict[str, str | None], defaults: list,
             overrides: list[str], dirs: list[Path]) -> dict[str, str]:
    """Dotted key -> the file that set it last (the defaults list, file by file, in order),
    or the command line."""
    groups = {g for g in choices if not g.startswith("hydra")}
    setters: dict[str, str] = {}
    for item in defaults:
        path = item.config_path
        if not path or path.startswith("hydra/") or (item.package or "").startswith("hydra"):
            continue
        file = _find(path, dirs)
        if file is None:
            continue
        data = {k: v for k, v in _yaml(file).items() if k not in ("defaults", "hydra")}
        for part in reversed(item.package.split(".") if item.package else []):
            data = {part: data}
        for key in flatten(config_name, data):
            setters[key] = str(file)
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.key_or_group not in groups:
            setters[override.key_or_group] = COMMAND_LINE
    return setters


def _find(config_path: str, dirs: list[Path]) -> Path | None:
    for root in dirs:
        file = root / f"{config_path}.yaml"
        if file.is_file():
            return file
    return None


def known_keys(config_name: str, dirs: list[Path]) -> set[str]:
    """Every key some file of the config defines: for suggestions when composition failed."""
    keys: set[str] = set()
    primary = _find(config_name, dirs)
    if primary:
        data = _yaml(primary)
        keys |= set(flatten(config_name, {k: v for k, v in data.items()
                                          if k not in ("defaults", "hydra")}))
    if config_name != "config":  # merge.yaml and data_build.yaml choose no groups
        return keys
    for root in dirs:
        for file in (f for d in group_dirs(root) for f in d.glob("*.yaml")):
            group = file.parent.name
            try:
                data = dict(_yaml(file))
            except ConfigError:  # a broken file the command does not use: no suggestions
                continue
            if "@package _global_" not in file.read_text():
                data = {group: data}
            data.pop("defaults", None)
            data = {k: v for k, v in data.items() if k == group}
            keys |= set(flatten(config_name, data))
    return keys


def _composition_error(err: Exception, config_name: str, dirs: list[Path]) -> str:
    """One line for what Hydra (or YAML) refused."""
    if isinstance(err, yaml.YAMLError):
        return yaml_problem(err)
    message = str(err)
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        missing = err.missing_cfg_file
        group, _, option = missing.rpartition("/")
        options = list(err.options or [])
        if options:
            return (f"{group}={option}: no such option in {group}/ (choose from "
                    f"{', '.join(options)}){did_you_mean(option, options)}")
        groups = {d.name for root in dirs for d in group_dirs(root)}
        hint = did_you_mean(group, groups) or " (groups: " + ", ".join(sorted(groups)) + ")"
        return f"{group}={option}: no config group '{group}'{hint}"
    if isinstance(err, OverrideParseException):
        bad = getattr(err, "override", None) or ""
        return f"cannot parse the override {bad!r}: {message.splitlines()[0]}".replace(
            "cannot parse the override '': ", "cannot parse an override: ")
    found = re.match(r"Could not override '([^']+)'", message)
    if found:
        return _unknown_key(found.group(1), config_name, dirs)
    found = re.match(r"Could not append to config\. An item is already at '([^']+)'", message)
    if found:
        return (f"'+{found.group(1)}=...' adds a key that exists: set it without the + "
                f"({found.group(1)}=...)")
    found = re.search(r"Could not (?:load|find) '([^']+)'", message)
    if found:
        group, _, option = found.group(1).rpartition("/")
        return f"{group}={option}: no such config file {found.group(1)}.yaml"
    cause = err.__cause__ or err.__context__
    text = message.strip() or (str(cause).strip() if cause else "") or type(err).__name__
    return text.splitlines()[0]


def _unknown_key(key: str, config_name: str, dirs: list[Path]) -> str:
    known = known_keys(config_name, dirs)
    if "." not in key and config_name == "config":  # perhaps a group: sweeps=lr_wd
        known |= {d.name for root in dirs for d in group_dirs(root)}
    return (f"unknown key '{key}' (set by {COMMAND_LINE}): the config has no such key"
            f"{did_you_mean(key, known)}")


def _bad_group_value(overrides: list[str], dirs: list[Path]) -> str | None:
    """`engine=null`, `engine=64`: a config group given something other than an option name."""
    groups = {d.name for root in dirs for d in group_dirs(root)}
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - only for the message; Hydra's own error stands
        return None
    for override in parsed:
        value = override.value()
        if override.key_or_group in groups and not isinstance(value, str | list):
            options = sorted({f.stem for root in dirs
                              for f in (root / override.key_or_group).glob("*.yaml")})
            return (f"{override.input_line}: a config group takes an option's name, not "
                    f"{value!r} (choose from {', '.join(options)})")
    return None


def _odd_input(err: Exception) -> str:
    if isinstance(err, OSError):
        where = f" ({str(err.filename)[:80]})" if err.filename else ""
        return f"cannot read a config file{where}: {err.strerror or err}"
    if isinstance(err, UnicodeError):
        return f"a config file is not UTF-8 text: {err}"
    text = " ".join(str(err).split())[:200]
    if "Config group override must be" in text:
        return f"a config group's option must be a name: {text}"
    return f"cannot compose the command line: {text}"


def yaml_problem(err: yaml.YAMLError) -> str:
    """'FILE:LINE:COL: malformed YAML: problem' from a YAML error."""
    mark = getattr(err, "problem_mark", None)
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "a YAML file"
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{where}: malformed YAML: {problem}"


def plain(cfg: DictConfig, key: str) -> Any:
    """The value at a dotted key, resolved, as plain Python (lists and dicts)."""
    value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True, throw_on_missing=True)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
