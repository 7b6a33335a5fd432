"""The compose-time schema against the shipped YAML: every key typed, every rule used, every
shipped value and experiment allowed, and each rule's bounds exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli import checks, flags
from capibara_exp.cli.common import register_resolvers
from capibara_exp.composing import config_schema
from capibara_exp.composing.config_check import flatten
from tests.conftest import EXPERIMENTS

CONFIG_ROOTS = {"config.yaml": "config", "merge.yaml": "merge", "data_build.yaml": "data_build",
                "meta.yaml": "meta"}
GROUP_ROOTS = {"meta_consensus": "meta"}  # groups of another root than config.yaml


def shipped_keys() -> dict[tuple[str, str], tuple[object, Path]]:
    """(config name, dotted key) -> (default, file) for every key a shipped file defines."""
    out = {}
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        rel = path.relative_to(CONF_DIR)
        if rel.parts[0] in ("hydra", "experiment", "debug") or rel.name.startswith("_"):
            continue
        data = yaml.safe_load(path.read_text()) or {}
        data.pop("defaults", None)
        data.pop("hydra", None)
        name = CONFIG_ROOTS.get(str(rel), GROUP_ROOTS.get(rel.parts[0], "config"))
        if len(rel.parts) > 1 and "@package _global_" not in path.read_text():
            data = {rel.parts[0]: data}
        if len(rel.parts) > 1:  # a group's file defines its group's keys only
            data = {k: v for k, v in data.items() if k == rel.parts[0]}
        for key, value in flatten(name, data).items():
            out[(name, key)] = (value, path)
    return out


def test_every_shipped_key_has_a_type() -> None:
    untyped = [f"{key} ({path})" for (name, key), (value, path) in shipped_keys().items()
               if config_schema.rule_for(name, key, value) is None]
    assert not untyped, ("keys whose default is null, ??? or an interpolation need a RULES "
                         f"entry in capibara_exp/composing/config_schema.py: {untyped}")


def test_every_rule_names_a_shipped_key() -> None:
    keys = {(name, key) for name, key in shipped_keys()}
    added_by_code = {"sweep_trial"}  # set by the sweeper on its trials
    stale = [f"{name}:{key}" for name, table in config_schema.RULES_BY_CONFIG.items()
             for key in table if (name, key) not in keys and key not in added_by_code]
    assert not stale, f"rules for keys no YAML file has: {stale}"


def test_every_shipped_default_satisfies_its_rule() -> None:
    bad = []
    for (name, key), (value, path) in shipped_keys().items():
        rule = config_schema.rule_for(name, key, value)
        if rule and not (isinstance(value, str) and ("${" in value or value == "???")):
            problem = rule.problem(value)
            if problem:
                bad.append(f"{key}={value} in {path}: expected {problem}")
    assert not bad, bad


@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_every_shipped_experiment_passes_the_checks(experiment: str | None) -> None:
    register_resolvers()
    args = [f"experiment={experiment}"] if experiment else []
    line = flags.parse([*args, "model_dir=/tmp/x"])
    checks.compose_checked(line, "config")  # raises on any problem


@pytest.mark.parametrize("rule, good, bad", [
    (config_schema.Int(1), [1, 10**9], [0, -1, 1.0, True, "1", None]),
    (config_schema.Float(gt=0.0, le=1.0), [1e-9, 0.5, 1, 1.0], [0, 0.0, 1.0001, float("nan"),
                                                                 float("inf"), "0.1", False]),
    (config_schema.Float(0.0, lt=1.0), [0, 0.999], [1.0, -1e-12]),
    (config_schema.Int(0, null=True), [None, 0], [-1]),
    (config_schema.Choice("a", "b"), ["a"], ["c", None, 1]),
    (config_schema.ListOf(config_schema.Int(1)), [[], [1, 2]], [[0], "1", [1.5]]),
    (config_schema.MapOf(config_schema.Int(1)), [{"targets": 8}], [{"targets": 0}, [8]]),
])
def test_rules_hold_their_bounds_exactly(rule, good, bad) -> None:
    assert [v for v in good if rule.problem(v)] == []
    assert [v for v in bad if rule.problem(v) is None] == []


def test_merge_parameters_are_checked_by_the_registrys_own_checks() -> None:
    """merge.yaml's method parameters and consensus.merge_params take their rules from
    composing/merge_methods.py (one table): what it refuses, the schema refuses, in its words."""
    from capibara_exp.composing import merge_methods

    checks = merge_methods.param_checks()
    cases = {"weights": ([1.0, 0.0], [1.0, float("inf")]), "num_byzantine": (2, -1),
             "num_selected": (None, 0), "scale": (-0.5, float("nan")), "density": (1.0, 0.0),
             "learn_steps": (3, 0), "learn_rate": (0.1, 0.0), "per_layer": (False, "yes"),
             "gamma": (0.0, 1.0), "epsilon": (0.1, -0.1), "normalize": (None, "no"),
             "rescale": (False, None), "seed": (3, -1), "t": ([0.0, 1.0], 1.5)}
    assert sorted(cases) == sorted(checks)  # a new parameter gets a case here
    for name, (good, bad) in cases.items():
        rule = config_schema.rule_for("merge", name, None)
        assert rule.problem(good) is None, name
        assert rule.problem(bad) == checks[name](bad).removeprefix("must be "), name
    params = config_schema.rule_for("config", "consensus.merge_params", None)
    assert params.problem(None) is None and params.problem({"num_byzantine": 1}) is None
    assert "num_byzantine is an integer >= 0" in params.problem({"num_byzantine": -1})
    assert "got 'num_byzantin'" in params.problem({"num_byzantin": 1})


def test_the_memory_warning_threshold_is_a_conf_key() -> None:
    from capibara_exp.base.paths import GIN_DIR
    from capibara_exp.composing import gin_bridge
    from tests.conftest import compose_config

    text = gin_bridge.render(compose_config(["monitor=default",
                                             "monitor.memory_warn_fraction=0.9"]),
                             "local", GIN_DIR)
    assert "MEMORY_WARN_FRACTION = 0.9" in text
    assert "train_script.train.memory_warn_fraction = %MEMORY_WARN_FRACTION" in text
