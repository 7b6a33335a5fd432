"""Every use of another library's private API in capibara-exp, each with why no public one
will do. Nothing else may reach into a library's private names: code that needs one calls
it from here, and tests/test_private_apis.py fails, naming the symbol, when an upgrade of
the library removes or changes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import optuna


class PrivateUse(NamedTuple):
    module: str  # where the library defines it
    name: str  # its (dotted) name in that module
    why: str  # why no public API will do


USES = (
    PrivateUse(
        "optuna.storages", "RDBStorage._get_stale_trial_ids",
        "the trials whose heartbeat is older than the grace period, still RUNNING. Optuna's "
        "public fail_stale_trials (and its heartbeat_stale_trial_callback) marks them FAIL "
        "first, after which the storage refuses to record on the trial why it failed; the "
        "sweep's failure rate and its reports tell a dead machine's trial from a failing "
        "job by that reason."),
    PrivateUse(
        "jax._src.distributed", "State.initialize",
        "jax.distributed.initialize keeps the coordination service's client on "
        "jax._src.distributed.global_state.client; JAX's public API offers no other way to it "
        "(see the next use)."),
    PrivateUse(
        "jaxlib._jax", "DistributedRuntimeClient.key_value_try_get",
        "the key-value store of JAX's coordination service, which every process of a run "
        "reaches without a collective: each raises a counter there and reads the others' "
        "(launch/peers.py), and says which process it lost, with exit 75, before the "
        "service's heartbeat timeout aborts them all naming nobody; a collective that "
        "includes a dead process only hangs. JAX's public API has no such store."),
    PrivateUse(
        "omegaconf._utils", "get_yaml_loader",
        "the YAML loader OmegaConf.load builds for every config file Hydra reads: PyYAML's "
        "pure-Python SafeLoader with OmegaConf's float resolver and duplicate-key check. "
        "Reading the files is a third of a composition, which every command (--help, --cfg "
        "job, a mistake) pays; OmegaConf offers no public way to choose libyaml's parser. "
        "capibara-exp's own compositions (cli/compose.py) read them with the same loader on "
        "libyaml's parser (see libyaml_for_omegaconf); Hydra's job composes as it always "
        "does."),
    PrivateUse(
        "omegaconf._utils", "parse",
        "the check OmegaConf makes of every string with an interpolation each time a node is "
        "set (a file read, each merge, each copy): its grammar parses the whole string "
        "(conf/config.yaml's help template, the run dir's pattern) in pure Python, a few ms a "
        "string, the same strings again at every step of a composition. capibara-exp's own "
        "compositions (cli/compose.py) check each string once a process (see "
        "interpolations_checked_once): one that fails is checked, and fails, every time; "
        "OmegaConf has no public switch for this check."),
    PrivateUse(
        "hydra._internal.config_loader_impl", "ConfigLoaderImpl._apply_overrides_to_config",
        "Hydra's second step of a composition: the command line's overrides of the app's "
        "keys applied, in order, to the config its defaults list composed. A line that only "
        "sets values on a line kept composed (cli/compose_rest.py) takes that config and "
        "this step, not a whole composition; Hydra's public API composes only whole lines."),
    PrivateUse(
        "hydra._internal.config_loader_impl", "get_overrides_dirname",
        "hydra.job.override_dirname, which Hydra records of a composed line; made again for "
        "the line cli/compose_rest.py composes (see the use above), as Hydra makes it."),
)


def stale_trial_ids(storage: optuna.storages.RDBStorage, study_id: int) -> list[int]:
    """The ids of the study's RUNNING trials whose last heartbeat, by the database's clock,
    is older than the storage's grace period (see USES)."""
    return storage._get_stale_trial_ids(study_id)


def distributed_client() -> object | None:
    """JAX's coordination-service client in this process (None before
    jax.distributed.initialize): `key_value_set(key, value, allow_overwrite)`,
    `key_value_try_get(key)`, `blocking_key_value_get(key, timeout_ms)` (see USES)."""
    from jax._src import distributed

    return distributed.global_state.client


@contextlib.contextmanager
def libyaml_for_omegaconf() -> Iterator[None]:
    """While the block runs, OmegaConf.load parses with libyaml (where PyYAML has it): the
    same resolvers and the same duplicate-key error, several times faster (see USES)."""
    import yaml
    from omegaconf import _utils

    if not getattr(yaml, "__with_libyaml__", False):
        yield
        return
    pure = _utils.get_yaml_loader()

    class Loader(yaml.CSafeLoader):
        yaml_implicit_resolvers = pure.yaml_implicit_resolvers  # OmegaConf's floats, no dates

        def construct_mapping(self, node, deep=False):
            seen = set()  # OmegaConf refuses a key given twice in one mapping
            for key_node, _ in node.value:
                if key_node.tag != yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    continue
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key_node.value}", key_node.start_mark)
                seen.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    saved = _utils.get_yaml_loader
    _utils.get_yaml_loader = lambda: Loader
    try:
        yield
    finally:
        _utils.get_yaml_loader = saved


_CHECKED: set[str] = set()  # interpolation strings OmegaConf's grammar accepted


@contextlib.contextmanager
def interpolations_checked_once() -> Iterator[None]:
    """While the block runs, OmegaConf's check of an interpolation string's syntax (the
    grammar's parse, whose tree it drops) runs once per string a process: a string that
    parsed once parses again (see USES); one that fails fails each time, as before."""
    from omegaconf import _utils

    real = _utils.parse

    def parse(value: str, *args: object, **kwargs: object) -> object:
        if args or kwargs or value not in _CHECKED:
            tree = real(value, *args, **kwargs)
            if not (args or kwargs):
                _CHECKED.add(value)
            return tree
        return None  # OmegaConf's check only asks whether it raises

    _utils.parse = parse
    try:
        yield
    finally:
        _utils.parse = real


def apply_hydra_overrides(overrides: list, cfg: object) -> None:
    """Apply parsed overrides of the app's keys to a composed config as Hydra's composition
    does after its defaults list (see USES)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def hydra_overrides_dirname(overrides: list, kv_sep: str, item_sep: str,
                            exclude_keys: list) -> str:
    """hydra.job.override_dirname of these parsed overrides, as Hydra makes it (see USES)."""
    from hydra._internal.config_loader_impl import get_overrides_dirname

    return get_overrides_dirname(overrides=overrides, exclude_keys=list(exclude_keys),
                                 item_sep=item_sep, kv_sep=kv_sep)
