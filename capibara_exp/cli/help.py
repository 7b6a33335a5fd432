"""`capibara-exp --help` and `--cfg job` in a fraction of Hydra's time, with Hydra's text.

Hydra renders its `hydra.help.template` after listing every config group's options, and it
lists each group through a config repository it builds anew (the primary config read and
deep-copied) per group, twice: on two cores that is seconds. The template, its
substitutions and the listing's format are Hydra's (`group: option, option`, groups
sorted, hydra/ groups left out of $APP_CONFIG_GROUPS); here the options are read from the
search path's directories once, and the config is composed once. `--cfg job` prints the
composition the checks made (Hydra would compose it a second time), as Hydra prints it:
the YAML of the config without its `hydra` node, unresolved.
"""

from __future__ import annotations

import string
from pathlib import Path

from omegaconf import OmegaConf

from capibara_exp.base.paths import SWEEPS_ROOT
from capibara_exp.cli import compose as composing
from capibara_exp.cli.flags import CommandLine
from capibara_exp.composing.config_check import group_dirs

HELP_FLAGS = ("--help", "-h")


def wants_help(line: CommandLine) -> bool:
    return any(a in HELP_FLAGS for a in line.flags)


def render(config_name: str, line: CommandLine) -> str:
    """The app's help text for a command line (its overrides apply, as in Hydra)."""
    comp = composing.compose(config_name, list(line.overrides), line.config_dirs, cached=True)
    composing.keep(comp)
    cfg = comp.cfg
    template = string.Template(OmegaConf.select(cfg, "hydra.help.template"))
    # sweeps/ is on the search path through hydra.searchpath, which Hydra's listing does not
    # follow: the template names the sweeps on a line of its own.
    values = {"APP_CONFIG_GROUPS": config_groups([d for d in comp.search_dirs
                                                  if d != SWEEPS_ROOT])}
    if "CONFIG" in template.get_identifiers():  # printed only where a template shows it
        values["CONFIG"] = job_config(cfg)  # the config without its hydra node, as Hydra's
    return template.safe_substitute(values)


def config_groups(search_dirs: list[Path]) -> str:
    """Hydra's compact listing of the app's config groups: `group: a, b` per line, sorted."""
    groups: dict[str, set[str]] = {}
    for root in search_dirs:
        for directory in group_dirs(root):
            if directory.name == "hydra":
                continue
            _collect(directory, directory.name, groups)
    return "".join(f"{group}: {', '.join(sorted(options))}\n"
                   for group, options in sorted(groups.items()) if options)


def _collect(directory: Path, group: str, groups: dict[str, set[str]]) -> None:
    groups.setdefault(group, set()).update(p.stem for p in directory.glob("*.yaml"))
    for sub in sorted(d for d in directory.iterdir() if d.is_dir()
                      and not d.name.startswith(("_", "."))):
        _collect(sub, f"{group}/{sub.name}", groups)


def plain_job_config(line: CommandLine) -> bool:
    """`--cfg job`, with no Hydra flag but --config-dir (no --package, --resolve, -m):
    what `job_config` prints as Hydra does."""
    pairs, flags = [], list(line.flags)
    while flags:
        flag = flags.pop(0)
        name, eq, value = flag.partition("=")
        if not eq and name in ("--cfg", "-c", "--config-dir", "-cd") and flags:
            value = flags.pop(0)
        pairs.append((name, value))
    shown = [value for name, value in pairs if name in ("--cfg", "-c")]
    others = [name for name, _ in pairs if name not in ("--cfg", "-c", "--config-dir", "-cd")]
    return shown == ["job"] and not others


def job_config(cfg: object) -> str:
    """Hydra's `--cfg job` text for a composed config (its keys but `hydra`, unresolved)."""
    if "hydra" not in cfg:  # a copy without it already (checks.without_hydra)
        return OmegaConf.to_yaml(cfg)
    return OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
