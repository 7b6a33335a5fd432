"""The merge-method registry is the one table the console script's keys and help, the
consensus action and merge() read; bad parameters are errors, not clamps."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from capibara_exp.base.paths import CONF_DIR
from capibara_exp.composing import merge_methods
from capibara_exp.composing.merge_methods import METHODS, MergeSpec
from capibara_exp.consensus import action


def test_conf_merge_yaml_has_every_parameter_with_the_registrys_default() -> None:
    conf = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "merge.yaml"), resolve=False)
    fields = dataclasses.fields(MergeSpec)[1:]
    assert {f.name: conf[f.name] for f in fields} == {f.name: f.default for f in fields}
    used = {p for m in METHODS.values() for p in m.params}
    assert used == set(merge_methods.param_names())  # no parameter that no method reads
    text = (CONF_DIR / "merge.yaml").read_text()
    assert all(re.search(rf"^{f.name}: .*# ", text, re.M) for f in fields)  # each explained


def test_the_console_help_is_the_registrys() -> None:
    script = Path(sys.executable).parent / "capibara-exp-merge"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert merge_methods.help_text() in done.stdout
    for name, method in METHODS.items():
        assert re.search(rf"^  {name} +{re.escape(method.help)}", done.stdout, re.M)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "weighted"}, "weights: method=weighted needs one weight per candidate, got null"),
    ({"method": "weighted", "weights": [1.0, float("nan")]}, "weights: must be a list of finite"),
    ({"method": "task_arithmetic", "scale": float("inf")}, "scale: must be a finite number"),
    ({"method": "ties", "density": 1.5}, r"density: must be in \(0, 1\], got 1.5"),
    ({"method": "learned", "learn_rate": 0.0}, "learn_rate: must be a finite number > 0"),
    ({"method": "learned", "per_layer": "yes"}, "per_layer: must be true or false"),
    ({"method": "krum", "num_byzantine": 1.0}, "num_byzantine: must be an integer >= 0"),
    ({"method": "uniform", "num_selected": 2}, "num_selected=2 is not a parameter of "
                                               "method=uniform"),
])
def test_bad_parameters_are_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MergeSpec(**kwargs)


def test_bounds_for_the_candidates_given_are_errors_not_clamps() -> None:
    MergeSpec("trimmed_mean", num_byzantine=2).check_candidates(5)
    with pytest.raises(ValueError, match=r"needs at least 5 candidates \(n > 2f\), got 4"):
        MergeSpec("trimmed_mean", num_byzantine=2).check_candidates(4)
    MergeSpec("krum", num_byzantine=2).check_candidates(7)
    with pytest.raises(ValueError, match=r"needs at least 7 candidates \(n > 2f \+ 2\), got 6"):
        MergeSpec("krum", num_byzantine=2).check_candidates(6)
    with pytest.raises(ValueError, match=r"num_selected=5 must be in \[1, n - f\] = \[1, 4\]"):
        MergeSpec("multi_krum", num_byzantine=1, num_selected=5).check_candidates(5)
    with pytest.raises(ValueError, match="one weight per candidate \\(3\\), got 2"):
        MergeSpec("weighted", weights=(1.0, 1.0)).check_candidates(3)
    with pytest.raises(ValueError, match="merge parameter 'f' is not one of weights, "):
        merge_methods.spec_from("krum", {"f": 1})


def test_the_action_takes_the_registrys_parameters(tmp_path) -> None:
    merge = action.ConsensusMerge(str(tmp_path), total_steps=4, method="trimmed_mean",
                                  last_k=3, merge_params={"num_byzantine": 1})
    assert merge.spec == MergeSpec("trimmed_mean", num_byzantine=1)
    for params, message in (({"num_byzantine": 2}, r"needs at least 5 checkpoints \(last_k\)"),
                            ({"scale": 2.0}, "scale=2.0 is not a parameter of method=trimmed"),
                            ({"f": 1}, "merge parameter 'f' is not one of")):
        with pytest.raises(ValueError, match=message):
            action.ConsensusMerge(str(tmp_path), total_steps=4, method="trimmed_mean", last_k=3,
                                  merge_params=params)
    with pytest.raises(ValueError, match="last_k must be an integer >= 1, got 0"):
        action.ConsensusMerge(str(tmp_path), total_steps=4, last_k=0)
