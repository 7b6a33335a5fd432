"""The best trial as a ready-to-run experiment: `<sweep dir>/best/experiment/<study>_best.yaml`.

    capibara-exp --config-dir <sweep dir>/best experiment=<study>_best

The file rebuilds the trial's config from the sweep's fixed task overrides and the trial's
sampled values, as one experiment:
- `experiment=X`: the file takes the experiment's place, so it includes X first
  (`- /experiment/X`) and sets everything else over it;
- a group merged before the experiment (model, schedule, ...): `- override /group: option`,
  as any experiment does;
- a group merged after the experiment (debug) or added with `+group=option`: an
  experiment's override cannot reach it (Hydra expands the later defaults first), so the
  option's file is included after the experiment's, `- /group/option`;
- values: the file's own body, merged last (`_self_`), as the command line's were;
- `+sweeps=...` only configures the sweeper and is left out; deletions (`~key`) have no
  config-file form, so the command in the file's header carries them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from capibara_exp.base import atomic
from capibara_exp.base.errors import ConfigError

SWEEPS_GROUP = "sweeps"  # sweeps/*.yaml: hydra.sweeper settings only (sweeps/README.md)
EXPERIMENT = "experiment"


def _late_groups(groups: Sequence[str]) -> set[str]:
    """The groups merged after the experiment.

    `groups` lists the composed config's groups as `hydra.runtime.choices` does: in the order
    Hydra expanded them, the primary defaults list from its end, so the groups listed before
    `experiment` are the ones merged after it (tests compose real files to hold this)."""
    groups = list(groups)
    return set(groups[: groups.index(EXPERIMENT)]) if EXPERIMENT in groups else set()


def _set(body: dict[str, Any], key: str, value: Any) -> None:
    node = body
    *parents, leaf = key.split(".")
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"the best trial sets both {'.'.join(parents[: i + 1])}={node!r} "
                              f"and {key}: one config file cannot hold both")
    if isinstance(node.get(leaf), dict) and isinstance(value, Mapping):
        node[leaf].update(value)
    else:
        node[leaf] = value


def experiment_config(fixed: Sequence[str], params: Mapping[str, Any],
                      groups: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """(the experiment's content, overrides the command must still carry) for a trial that
    ran with the overrides `fixed` (Hydra strings) and the sampled values `params`."""
    known, late = set(groups), _late_groups(groups)
    parser = OverridesParser.create()
    items: list[tuple[str, Any]] = []
    on_command: list[str] = []
    for text in fixed:
        (override,) = parser.parse_overrides([text])
        if override.is_delete():
            on_command.append(text)
        else:
            items.append((override.get_key_element(), override.value()))
    items.extend(params.items())

    experiment: list[str] = []
    includes: list[str] = []
    overrides: list[dict[str, Any]] = []
    body: dict[str, Any] = {}
    for key, value in items:
        name = key.lstrip("+")
        if name == SWEEPS_GROUP:
            continue
        if name == EXPERIMENT:
            experiment = [] if value is None else [f"/{EXPERIMENT}/{value}"]
        elif name in known or "/" in name:
            if name in late or name not in known:
                if value is not None:
                    includes.append(f"/{name}/{value}")
            else:
                overrides.append({f"override /{name}": value})
        else:
            _set(body, name, value)
    defaults = [*experiment, *includes, *overrides]
    config = ({"defaults": [*defaults, "_self_"]} if defaults else {}) | body
    return config, on_command


def write(sweep_dir: Path, study_name: str, number: int, value: float, fixed: Sequence[str],
          params: Mapping[str, Any], groups: Sequence[str]) -> tuple[Path, str]:
    """Write the best trial's experiment file; (its path, the command that runs it)."""
    config, on_command = experiment_config(fixed, params, groups)
    name = f"{study_name}_best"
    config_dir = sweep_dir.absolute() / "best"
    command = " ".join(["capibara-exp", "--config-dir", str(config_dir),
                        f"{EXPERIMENT}={name}", *(f"'{o}'" for o in on_command)])
    path = config_dir / EXPERIMENT / f"{name}.yaml"
    header = (f"# @package _global_\n# {command}\n"
              f"# Trial {number} of study {study_name} (value {value}): the sweep's overrides "
              "and the trial's sampled values.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, header + yaml.safe_dump(config, sort_keys=False))
    return path, command
