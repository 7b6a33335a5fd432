"""The capibara_optuna sweeper: search spaces, resume, failures, pruning, a real sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import optuna.distributions as od
import pytest
import yaml
from optuna.trial import TrialState

from capibara_exp.gin_bridge import ConfigError
from capibara_exp.sweeping import space, study

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- search spaces


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a=choice(1, 2, 3)", od.CategoricalDistribution([1, 2, 3])),
        ("a=adam,sgd", od.CategoricalDistribution(["adam", "sgd"])),
        ("a=range(1, 10, 3)", od.IntDistribution(1, 7, step=3)),
        ("a=range(2, 5)", od.IntDistribution(2, 4)),
        ("a=range(0.1, 0.4, 0.1)", od.CategoricalDistribution([0.1, 0.2, 0.3])),
        ("a=tag(log, range(1, 65))", od.IntDistribution(1, 64, log=True)),
        ("a=interval(0.1, 0.9)", od.FloatDistribution(0.1, 0.9)),
        ("a=tag(log, interval(1e-5, 1e-2))", od.FloatDistribution(1e-5, 1e-2, log=True)),
        ("a=tag(int, interval(1, 8))", od.IntDistribution(1, 8)),
        ("a=tag(int, log, interval(1, 8))", od.IntDistribution(1, 8, log=True)),
    ],
)
def test_every_search_space_form(text: str, expected: od.BaseDistribution) -> None:
    parsed = space.parse([text])
    assert parsed.distributions == {"a": expected} and parsed.fixed == ()


def test_fixed_values_pass_through() -> None:
    parsed = space.parse(["model.emb_dim=64", "b=interval(0, 1)"])
    assert parsed.fixed == ("model.emb_dim=64",) and set(parsed.distributions) == {"b"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("a=interval(1, 1)", "is empty"),
        ("a=tag(log, interval(0, 1))", "positive lower bound"),
        ("a=tag(log, choice(1, 2))", "not choice"),
        ("a=interval(1,", "search space entry"),
    ],
)
def test_bad_search_spaces_are_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        space.parse([text])


def test_grid_needs_discrete_dimensions() -> None:
    assert space.parse(["a=choice(x, y)", "b=range(1, 3)"]).grid() == {"a": ["x", "y"], "b": [1, 2]}
    with pytest.raises(ConfigError, match="grid sampler needs a discrete"):
        space.parse(["a=interval(0, 1)"]).grid()


@pytest.mark.parametrize(
    "value, text", [("it's", "k='it\\'s'"), ("adam", "k=adam"), (0.5, "k=0.5")]
)
def test_sampled_values_become_hydra_overrides(value, text: str) -> None:
    assert space.to_override("k", value) == text


# ----------------------------------------------------------------------------- the study loop
# A plain Python job stands in for a training run here: these tests are about the loop's
# bookkeeping (resume, failures), which does not depend on what a job computes.


def quadratic(overrides: list[str], number: int) -> dict:
    x = float(dict(o.split("=") for o in overrides)["x"])
    return {"loss": (x - 0.3) ** 2}


def settings(**kw) -> study.SweepSettings:
    return study.SweepSettings(
        **{
            "study_name": "s",
            "sampler": "random",
            "seed": 0,
            "params": {"x": "interval(0, 1)"},
            **kw,
        }
    )


def test_rerunning_continues_the_study_to_n_trials_total(tmp_path: Path) -> None:
    calls: list[int] = []

    def job(overrides, number):
        calls.append(number)
        return quadratic(overrides, number)

    study.run(settings(n_trials=3), job, tmp_path)
    study.run(settings(n_trials=3), job, tmp_path)  # nothing left to do
    s = study.run(settings(n_trials=5), job, tmp_path)
    assert calls == [0, 1, 2, 3, 4]  # no trial run twice
    assert [t.state for t in s.trials] == [TrialState.COMPLETE] * 5
    results = yaml.safe_load((tmp_path / study.RESULTS).read_text())
    assert results["trials"]["complete"] == 5 and "best_params" in results
    best = (tmp_path / "best" / "experiment" / "s_best.yaml").read_text()
    assert best.startswith("# @package _global_") and "x:" in best
    assert results["plots"]["intermediate_values"].startswith("not drawn: no trial reported")
    for name in ("optimization_history", "param_importances"):
        png = Path(results["plots"][name])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_plots_are_explained_when_there_is_too_little_to_draw(tmp_path: Path) -> None:
    study.run(settings(n_trials=1), quadratic, tmp_path)
    plots = yaml.safe_load((tmp_path / study.RESULTS).read_text())["plots"]
    assert plots["optimization_history"] == "not drawn: fewer than 2 complete trials"


@pytest.mark.parametrize(
    "sweep_file", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_shipped_sweep_composes_to_keys_that_exist(sweep_file: Path) -> None:
    """A sweep's keys must name real config keys: a typo would only show after a trial ran."""
    command = sweep_file.read_text().splitlines()[1]  # "# capibara-exp -m ARGS": its own command
    assert command.startswith("# capibara-exp -m "), command
    args = command.split()[3:]
    out = subprocess.run(
        [sys.executable, "-m", "capibara_exp.cli", *args, "--cfg", "all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)
    sweeper = cfg["hydra"]["sweeper"]
    assert sweeper["_target_"].endswith("CapibaraOptunaSweeper")
    parsed = space.parse([f"{k}={v}" for k, v in sweeper["params"].items()])
    assert parsed.distributions and not parsed.fixed
    for key in parsed.distributions:
        node = cfg
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{sweep_file.name}: {key} is not a key"
            node = node[part]


def test_a_trial_of_a_killed_sweep_is_marked_failed_and_the_sweep_goes_on(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    url = study.storage_url(None, tmp_path)
    s = study.open_study(settings(), url, space.parse(["x=interval(0, 1)"]))
    orphan = s.ask({"x": od.FloatDistribution(0, 1)})
    orphan.set_user_attr("host", os.uname().nodename)
    orphan.set_user_attr("pid", int(dead.stdout))  # that process has exited
    s = study.run(settings(n_trials=3), quadratic, tmp_path)
    states = [t.state for t in s.trials]
    assert states == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert s.trials[0].user_attrs[study.ERROR] == study.ORPHANED


def test_failing_trials_are_recorded_and_the_failure_rate_stops_the_sweep(tmp_path: Path) -> None:
    def flaky(overrides, number):
        if number % 2:
            raise RuntimeError(f"job {number} broke")
        return quadratic(overrides, number)

    s = study.run(settings(n_trials=4, max_failure_rate=0.5), flaky, tmp_path)
    assert [t.state.name for t in s.trials] == ["COMPLETE", "FAIL", "COMPLETE", "FAIL"]
    assert s.trials[1].user_attrs[study.ERROR] == "RuntimeError: job 1 broke"
    with pytest.raises(
        ConfigError, match=r"3 of 5 finished trials failed.*\(trial 4\): RuntimeError"
    ):
        study.run(
            settings(n_trials=8, max_failure_rate=0.5),
            lambda o, n: flaky(o, 1) if n == 4 else flaky(o, n),
            tmp_path,
        )


def test_multi_objective_results_are_the_pareto_front(tmp_path: Path) -> None:
    def two(overrides, number):
        x = float(dict(o.split("=") for o in overrides)["x"])
        return {"loss": x, "cost": 1 - x}

    study.run(
        settings(n_trials=4, direction=["minimize", "minimize"], metric=["loss", "cost"]),
        two,
        tmp_path,
    )
    front = yaml.safe_load((tmp_path / study.RESULTS).read_text())["pareto_front"]
    assert len(front) == 4  # every point of x -> (x, 1 - x) is Pareto-optimal


# ----------------------------------------------------------------------------- real sweeps


def sweep(tmp_path: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # Run from the checkout, where Hydra finds the sweeper in hydra_plugins/.
    cmd = [
        sys.executable,
        "-m",
        "capibara_exp.cli",
        "-m",
        "hydra/sweeper=capibara_optuna",
        "debug=fast",
        "model.emb_dim=32",
        "model.mlp_dim=64",
        "data.batch_size=4",
        f"data_dir={data_dir}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *args,
    ]
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ)
    )
    return out


@pytest.mark.slow
def test_pruning_stops_bad_trials_early(tmp_path: Path, data_dir: Path) -> None:
    common = [
        "hydra.sweeper.pruner=median",
        "hydra.sweeper.sampler=random",
        "trainer.train_steps=6",
        "trainer.eval_period=1",
        "checkpoint.checkpoint_period=6",
        "schedule.warmup_steps=1",
        "schedule.lr_factors=constant",
    ]
    # Two good learning rates first (the median pruner's start-up trials), then, resuming
    # the same study, a learning rate too small to learn anything in six steps.
    out = sweep(
        tmp_path,
        data_dir,
        *common,
        "hydra.sweeper.n_trials=2",
        "schedule.base_learning_rate=interval(0.003, 0.01)",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    out = sweep(
        tmp_path,
        data_dir,
        *common,
        "hydra.sweeper.n_trials=3",
        "schedule.base_learning_rate=interval(1e-7, 1e-6)",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    s = optuna.load_study(
        study_name="dense_tiny_lm", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}"
    )
    good, bad = s.trials[:2], s.trials[2]
    assert len(s.trials) == 3
    assert all(t.state == TrialState.COMPLETE and max(t.intermediate_values) == 6 for t in good)
    assert bad.state == TrialState.PRUNED  # worse than the median: stopped early
    assert max(bad.intermediate_values) < 6
    results = yaml.safe_load((tmp_path / "sweep" / study.RESULTS).read_text())
    assert results["best_trial"] in (0, 1)
    assert results["trials"] == {"complete": 2, "pruned": 1, "fail": 0}
    assert Path(results["plots"]["intermediate_values"]).suffix == ".png"  # the eval curves
    # The storage URL (it may hold a password) reaches the job through the environment.
    job_dir = tmp_path / "sweep" / "0" / ".hydra"
    for name in ("overrides.yaml", "config.yaml"):
        text = (job_dir / name).read_text()
        assert "CAPIBARA_SWEEP_STORAGE" in text and "optuna.db" not in text, name


@pytest.mark.slow
def test_a_failing_trial_does_not_end_a_real_sweep(tmp_path: Path, data_dir: Path) -> None:
    out = sweep(
        tmp_path,
        data_dir,
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.max_failure_rate=1.0",
        "model.position_embedding=choice(rope, alibi)",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    s = optuna.load_study(
        study_name="dense_tiny_lm", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}"
    )
    states = {t.params["model.position_embedding"]: t for t in s.trials}
    assert states["rope"].state == TrialState.COMPLETE
    assert states["alibi"].state == TrialState.FAIL
    assert "DecoderConfig.position_embedding" in states["alibi"].user_attrs[study.ERROR]


def test_a_changed_choice_is_a_clear_error_and_leaves_no_running_trial(tmp_path: Path) -> None:
    study.run(
        settings(n_trials=1, params={"x": "choice(1, 2)"}), lambda o, n: {"loss": 1.0}, tmp_path
    )
    with pytest.raises(ConfigError, match="a choice's values cannot change within a study"):
        study.run(
            settings(n_trials=2, params={"x": "choice(3)"}), lambda o, n: {"loss": 1.0}, tmp_path
        )
    s = optuna.load_study(study_name="s", storage=study.storage_url(None, tmp_path))
    assert [t.state for t in s.trials] == [TrialState.COMPLETE, TrialState.FAIL]


def test_grid_runs_every_point_once_then_stops(tmp_path: Path) -> None:
    seen: list[str] = []

    def job(overrides, number):
        seen.append(overrides[0])
        return {"loss": float(overrides[0].split("=")[1])}

    s = study.run(
        settings(n_trials=10, sampler="grid", params={"x": "choice(1, 2, 3)"}), job, tmp_path
    )
    assert sorted(seen) == ["x=1", "x=2", "x=3"] and len(s.trials) == 3


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "gp", "nsgaii"])
def test_every_sampler_drives_a_study(tmp_path: Path, sampler: str) -> None:
    """Each sampler runs a few real trials, or (gp without PyTorch) says what to install."""
    import importlib.util

    run = lambda: study.run(settings(n_trials=4, sampler=sampler), quadratic, tmp_path)  # noqa: E731
    if sampler == "gp" and importlib.util.find_spec("torch") is None:
        with pytest.raises(ConfigError, match=r"sampler=gp needs torch.*capibara-exp\[gp\]"):
            run()
        return
    s = run()
    assert [t.state for t in s.trials] == [TrialState.COMPLETE] * 4
    assert len({t.params["x"] for t in s.trials}) == 4
