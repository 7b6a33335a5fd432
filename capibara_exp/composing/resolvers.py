"""OmegaConf resolvers the shipped configs use (`${abspath:...}`, the help texts' lists):
one table, registered by every console script and by anything that composes the configs
(tests, the calibration), before Hydra reads them."""

from __future__ import annotations

import os
import textwrap

from omegaconf import OmegaConf

from capibara_exp.base.paths import SWEEPS_ROOT


def user_cache_dir(name: str) -> str:
    """<user cache dir>/capibara-exp/<name>: $XDG_CACHE_HOME, else ~/.cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(root), "capibara-exp", name)


def merge_methods() -> str:
    """The merge methods and their parameters (capibara-exp-merge --help), from their table."""
    from capibara_exp.composing import merge_methods

    return merge_methods.help_text()


def shipped_sweeps() -> str:
    """The search spaces in sweeps/ (the config group `sweeps`)."""
    return ", ".join(sorted(p.stem for p in (SWEEPS_ROOT / "sweeps").glob("*.yaml")))


def sweeper_keys() -> str:
    """The capibara_optuna sweeper's settings, from its YAML file."""
    import yaml

    from capibara_exp.base.paths import CONF_DIR

    # libyaml's safe loader where PyYAML has it (--help resolves this on every call)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    data = yaml.load((CONF_DIR / "hydra" / "sweeper" / "capibara_optuna.yaml").read_text(),
                     Loader=loader)
    keys = [k for k in data if not k.startswith("_")]
    return textwrap.fill(", ".join(keys), 84, subsequent_indent="  ")


RESOLVERS = {
    "capibara_sweeps": shipped_sweeps,
    "capibara_sweeper_keys": sweeper_keys,
    "capibara_merge_methods": merge_methods,
    "abspath": lambda p: os.path.abspath(os.path.expanduser(p)),
    "capibara_sweeps_root": lambda: str(SWEEPS_ROOT),
    "capibara_cache_dir": user_cache_dir,
    # ${capibara_or:${a},b}: a unless it is null
    "capibara_or": lambda value, default: default if value is None else value,
}


def register_resolvers() -> None:
    """OmegaConf resolvers the shipped configs use."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
