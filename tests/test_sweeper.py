"""The capibara_optuna sweeper: search spaces, resume, failures, pruning, a real sweep."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import optuna
import optuna.distributions as od
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from capibara_exp.base import optuna_study
from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import CONF_DIR, SWEEPS_ROOT
from capibara_exp.cli.common import register_resolvers
from capibara_exp.sweeping import best as best_lib
from capibara_exp.sweeping import search_space, study

ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILES = sorted((SWEEPS_ROOT / "sweeps").glob("*.yaml"))


def composed(overrides: list[str], hydra: bool = False, config_dir: Path | None = None
             ) -> DictConfig:
    """The config a command line composes (with `--config-dir config_dir`), run nothing."""
    register_resolvers()
    if config_dir is not None:  # what --config-dir does: one more config dir to search
        overrides = [f"hydra.searchpath=[file://{config_dir}]", *overrides]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra)


def sweeper_settings(sweeper: DictConfig) -> dict:
    """hydra.sweeper as SweepSettings' keywords (as the sweeper plugin builds them)."""
    return {k: v for k, v in OmegaConf.to_container(sweeper, resolve=True).items()
            if k != "_target_"}


def shipped_command(sweep_file: Path) -> list[str]:
    """The arguments of the command a sweep file opens with ("# capibara-exp -m ARGS")."""
    command = sweep_file.read_text().splitlines()[1]
    assert command.startswith("# capibara-exp -m "), command
    return command.split()[3:]

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
        # Hydra's casts, as users of the official plugin write them: int bounds, int values
        ("a=int(interval(1, 8))", od.IntDistribution(1, 8)),
        ("a=tag(log, int(interval(1, 64)))", od.IntDistribution(1, 64, log=True)),
        ("a=float(range(1, 4))", od.CategoricalDistribution([1.0, 2.0, 3.0])),
    ],
)
def test_every_search_space_form(text: str, expected: od.BaseDistribution) -> None:
    parsed = search_space.parse([text])
    assert parsed.distributions == {"a": expected} and parsed.fixed == ()


def test_fixed_values_pass_through() -> None:
    parsed = search_space.parse(["model.emb_dim=64", "b=interval(0, 1)"])
    assert parsed.fixed == ("model.emb_dim=64",) and set(parsed.distributions) == {"b"}


def test_a_fixed_command_line_value_wins_over_a_shipped_search(tmp_path: Path) -> None:
    """`+sweeps=lr_wd schedule.base_learning_rate=0.01`: the rate is fixed, not searched."""
    cfg = composed(["+sweeps=lr_wd"], hydra=True).hydra.sweeper
    shipped = study.SweepSettings(**{**sweeper_settings(cfg), "sampler": "random", "n_trials": 1})
    assert "schedule.base_learning_rate" in shipped.params
    ran: list[list[str]] = []
    s = study.run(shipped, lambda o, n: ran.append(o) or {"loss": 1.0}, tmp_path,
                  ["schedule.base_learning_rate=0.01"])
    assert [set(t.params) for t in s.trials] == [{"optimizer.weight_decay"}]
    for overrides in ran:
        rates = [o for o in overrides if o.startswith("schedule.base_learning_rate=")]
        assert rates == ["schedule.base_learning_rate=0.01"], overrides
    # and the other way round: a search on the command line replaces a fixed value
    assert set(search_space.parse(["a=1", "a=interval(0, 1)"]).distributions) == {"a"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("a=interval(1, 1)", "is empty"),
        ("a=tag(log, interval(0, 1))", "positive lower bound"),
        ("a=tag(log, choice(1, 2))", "not choice"),
        ("a=interval(1,", "search space entry"),
        ("a=tag(log, range(1, 65, 2))", "needs integer bounds and step 1"),
        ("a=tag(log, range(0, 8))", "start >= 1"),
        ("a=tag(int, interval(1.5, 8))", "needs whole bounds"),
    ],
)
def test_bad_search_spaces_are_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        search_space.parse([text])


def test_grid_needs_discrete_dimensions() -> None:
    grid = search_space.parse(["a=choice(x, y)", "b=range(1, 3)"]).grid()
    assert grid == {"a": ["x", "y"], "b": [1, 2]}
    with pytest.raises(ConfigError, match="grid sampler needs a discrete"):
        search_space.parse(["a=interval(0, 1)"]).grid()


@pytest.mark.parametrize(
    "value, text", [("it's", "k='it\\'s'"), ("adam", "k=adam"), (0.5, "k=0.5")]
)
def test_sampled_values_become_hydra_overrides(value, text: str) -> None:
    assert search_space.to_override("k", value) == text


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
    assert results["best_command"].endswith("experiment=s_best")
    assert results["plots"]["intermediate_values"].startswith("not drawn: no trial reported")
    for name in ("optimization_history", "param_importances"):
        png = Path(results["plots"][name])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_extending_a_study_never_repeats_a_finished_trials_parameters(tmp_path: Path) -> None:
    """n_trials 3 -> 4: the fourth trial is new (re-seeding the sampler with the bare seed
    replayed trial 0's parameters); the same command from scratch still samples the same."""
    first = study.run(settings(n_trials=3), quadratic, tmp_path / "a")
    before = [t.params["x"] for t in first.trials]
    extended = [t.params["x"] for t in study.run(settings(n_trials=4), quadratic,
                                                  tmp_path / "a").trials]
    assert extended[:3] == before and extended[3] not in before
    again = [t.params["x"] for t in study.run(settings(n_trials=3), quadratic,
                                               tmp_path / "b").trials]
    assert again == before  # deterministic for a seed
    seed = optuna_study.sampler_seed
    assert seed(0, 0, 0) != seed(0, 3, 0) != seed(0, 3, 1)


def test_a_sweep_reports_each_trial_its_summary_and_a_no_op_rerun(tmp_path: Path) -> None:
    cfg = settings(n_trials=5, pruner="median", params={"x": "interval(0, 6)"},
                   storage=str(tmp_path / "study.journal"))
    s = study.open_study(cfg, cfg.storage, search_space.parse(["x=interval(0, 6)"])).study
    for x in (0.3, 0.35, 5.0, 0.32, 6.0):  # two good, then a bad one the median pruner stops
        s.enqueue_trial({"x": x})
    lines: list[str] = []
    study.run(cfg, curve_job, tmp_path, report=lines.append)
    assert lines[0].startswith("trial 0: loss ") and "x=0.3" in lines[0]
    pruned = [line for line in lines if " pruned at step " in line]
    assert pruned and pruned[0].startswith("trial 2 pruned at step "), lines
    results = yaml.safe_load((tmp_path / study.RESULTS).read_text())
    text = "\n".join(study.summary(results, tmp_path))
    counts = results["trials"]
    assert f"5 trials ({counts['complete']} complete, {counts['pruned']} pruned, 0 failed)" in text
    assert f"best loss {results['best_value']:.6g} (trial {results['best_trial']}): x=" in text
    assert f"best command: {results['best_command']}" in text and str(tmp_path) in text
    lines.clear()
    study.run(cfg, curve_job, tmp_path, report=lines.append)  # the same command again
    assert len(lines) == 1 and "already holds n_trials=5" in lines[0], lines


def test_plots_are_explained_when_there_is_too_little_to_draw(tmp_path: Path) -> None:
    study.run(settings(n_trials=1), quadratic, tmp_path)
    plots = yaml.safe_load((tmp_path / study.RESULTS).read_text())["plots"]
    assert plots["optimization_history"] == "not drawn: fewer than 2 complete trials"


@pytest.mark.parametrize("sweep_file", SWEEP_FILES, ids=lambda p: p.stem)
def test_every_shipped_sweep_composes_to_keys_that_exist(sweep_file: Path) -> None:
    """A sweep's keys must name real config keys: a typo would only show after a trial ran."""
    args = shipped_command(sweep_file)
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
    parsed = search_space.parse([f"{k}={v}" for k, v in sweeper["params"].items()])
    assert parsed.distributions and not parsed.fixed
    for key in parsed.distributions:
        if key in cfg["hydra"]["runtime"]["choices"]:
            continue  # a config group (schedule=choice(...)): the key names no value
        node = cfg
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{sweep_file.name}: {key} is not a key"
            node = node[part]


def without_hydra(cfg: DictConfig) -> dict:
    return {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"}


@pytest.mark.parametrize("sweep_file", SWEEP_FILES, ids=lambda p: p.stem)
def test_the_best_trial_file_of_every_shipped_sweep_composes_to_that_trial(
        sweep_file: Path, tmp_path: Path) -> None:
    """The end of a sweep, without training: a finished trial sampled from the shipped space
    with the sweep's own command plus a fixed value and a late group (debug, merged after
    the experiment) -> write_results -> the best file composes to the trial's config."""
    args = [*shipped_command(sweep_file), "debug=fast", "trainer.train_steps=7", "random_seed=3"]
    cfg = composed(args, hydra=True)
    settings = study.SweepSettings(**sweeper_settings(cfg.hydra.sweeper))
    groups = list(cfg.hydra.runtime.choices)
    sweep_space = study.search_space(settings, args)
    s = optuna.create_study(study_name=settings.study_name,
                            sampler=optuna.samplers.RandomSampler(seed=1))
    for state in (TrialState.FAIL, TrialState.COMPLETE, TrialState.FAIL):  # trial 1 is best
        s.tell(s.ask(sweep_space.distributions), 1.0 if state == TrialState.COMPLETE else None,
               state=state)
    best = s.trials[1]
    results = study.write_results(s, settings, tmp_path, sweep_space.fixed, groups)
    assert results["best_trial"] == 1, results

    name = f"{settings.study_name}_best"
    best_cfg = composed([f"experiment={name}"], hydra=True, config_dir=tmp_path / "best")
    trial_cfg = composed(study.job_overrides(sweep_space, best.params), hydra=True)
    assert without_hydra(best_cfg) == without_hydra(trial_cfg)
    for key, value in best.params.items():  # the sampled values, not the defaults
        if key in groups:
            assert best_cfg.hydra.runtime.choices[key] == value, key
        else:
            assert OmegaConf.select(best_cfg, key) == value, key
    assert (best_cfg.trainer.train_steps, best_cfg.random_seed) == (7, 3)
    assert best_cfg.trainer.eval_period == 2  # debug=fast's, merged after the experiment
    if "experiment=moe_e2b_tiny" in args:
        assert best_cfg.name == "moe_e2b_tiny" and best_cfg.data.batch_size == 16


def test_the_best_trial_command_runs_from_the_command_line(tmp_path: Path) -> None:
    """The command written in the file (`--config-dir DIR experiment=NAME`), through the CLI."""
    fixed = ("experiment=moe_e2b_tiny", "debug=fast", "~model.router_bias")
    params = {"schedule": "warmup_cosine", "schedule.warmup_steps": 25,
              "model.capacity_factor": 1.5}
    groups = list(composed(list(fixed[:2]), hydra=True).hydra.runtime.choices)
    path, command = best_lib.write(tmp_path, "moe", 4, 0.5, fixed, params, groups)
    assert command.endswith("experiment=moe_best '~model.router_bias'")
    assert "- /experiment/moe_e2b_tiny" in path.read_text()
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", "--config-dir",
                          str(tmp_path / "best"), "experiment=moe_best", "--cfg", "job"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["schedule"]["lr_factors"].endswith("cosine_decay")  # the group's option
    assert cfg["schedule"]["warmup_steps"] == 25 and cfg["model"]["capacity_factor"] == 1.5
    assert cfg["name"] == "moe_e2b_tiny" and cfg["trainer"]["train_steps"] == 4  # debug=fast


def test_a_trial_of_a_killed_sweep_is_marked_failed_and_the_sweep_goes_on(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    url = study.storage_url(None, tmp_path)
    s = study.open_study(settings(), url, search_space.parse(["x=interval(0, 1)"])).study
    orphan = s.ask({"x": od.FloatDistribution(0, 1)})
    orphan.set_user_attr("host", os.uname().nodename)
    orphan.set_user_attr("pid", int(dead.stdout))  # that process has exited
    s = study.run(settings(n_trials=3), quadratic, tmp_path)
    states = [t.state for t in s.trials]
    # The dead process's trial is failed, then retried first (Optuna's retry callback: a
    # copy with its parameters), and the study still holds n_trials counted trials.
    assert states == [TrialState.FAIL] + [TrialState.COMPLETE] * 3
    assert s.trials[0].user_attrs[study.ERROR] == study.ORPHANED
    assert s.trials[1].params == s.trials[0].params
    assert s.trials[1].system_attrs["failed_trial"] == 0
    assert len(study.counted(s)) == 3


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


def test_a_first_failing_trial_does_not_stop_the_sweep(tmp_path: Path) -> None:
    """One failure of one finished trial is no rate: it applies from min(n_trials, 5) on."""

    def first_fails(overrides, number):
        if number == 0:
            raise RuntimeError("job 0 broke")
        return quadratic(overrides, number)

    cfg = settings(n_trials=5, max_failure_rate=0.5, storage=str(tmp_path / "s.journal"))
    s = study.run(cfg, first_fails, tmp_path)
    assert [t.state.name for t in s.trials] == ["FAIL"] + ["COMPLETE"] * 4


def test_multi_objective_results_are_the_pareto_front(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def two(overrides, number):
        x = float(dict(o.split("=") for o in overrides)["x"])
        return {"loss": x, "cost": 1 - x}

    study.run(
        settings(n_trials=4, direction=["minimize", "minimize"], metric=["loss", "cost"],
                 pruner="median"),
        two,
        tmp_path,
    )
    front = yaml.safe_load((tmp_path / study.RESULTS).read_text())["pareto_front"]
    assert len(front) == 4  # every point of x -> (x, 1 - x) is Pareto-optimal
    assert "hydra.sweeper.pruner=median is off" in caplog.text  # said, not silently dropped


def test_a_dead_machines_trial_is_failed_while_a_job_runs_and_retried(tmp_path: Path) -> None:
    """A trial RUNNING on another host (whose pid means nothing here) is failed by the
    background check once its heartbeat is stale, while this worker's own job runs (whose
    heartbeat stays fresh), and its retry runs next with its parameters."""
    cfg = settings(n_trials=2, heartbeat_interval=1, grace_period=2)
    url = study.storage_url(None, tmp_path)
    x = search_space.parse(["x=interval(0, 1)"])
    opened = study.open_study(cfg, url, x)
    dead = study._ask(opened, x)
    dead.set_user_attr("host", "another-machine")
    dead.set_user_attr("pid", os.getpid())  # alive here: only the heartbeat can tell
    opened.storage.record_heartbeat(opened.trial_id(dead.number))  # its machine's last one
    seen_during_job: list[TrialState] = []

    def job(overrides, number):
        if number == 1:  # wait (a hang fails the test) for the check to fail trial 0
            for _ in range(600):
                if opened.trial(0).state.is_finished():
                    break
                time.sleep(0.1)
            seen_during_job.extend([opened.trial(0).state, opened.trial(1).state])
        return quadratic(overrides, number)

    s = study.run(cfg, job, tmp_path)
    assert seen_during_job == [TrialState.FAIL, TrialState.RUNNING]
    assert [t.state for t in s.trials] == [TrialState.FAIL] + [TrialState.COMPLETE] * 2
    assert s.trials[0].user_attrs[study.ERROR] == study.STALE
    assert s.trials[2].params == s.trials[0].params  # the retry
    assert [t.number for t in study.counted(s)] == [1, 2]


def test_a_trial_failed_by_another_worker_while_it_ran_stays_failed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = settings(n_trials=2, storage=str(tmp_path / "s.journal"))

    def job(overrides, number):
        if number == 0:  # what a worker that found this trial's heartbeat stale does
            other = study.open_study(cfg, cfg.storage, study.search_space(cfg, ()))
            other.storage.set_trial_state_values(other.trial_id(0), TrialState.FAIL)
        return quadratic(overrides, number)

    s = study.run(cfg, job, tmp_path)  # no error telling a finished trial: the sweep goes on
    assert [t.state for t in s.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert "trial 0 was failed by another worker while it ran" in caplog.text


def test_heartbeats_are_on_where_other_machines_may_run_trials() -> None:
    assert study.heartbeat_interval(settings(), "postgresql://u@h/optuna") == study.HEARTBEAT_S
    assert study.heartbeat_interval(settings(), "sqlite:///x.db") is None  # the pid check
    assert study.heartbeat_interval(settings(), "/runs/study.journal") is None
    assert study.heartbeat_interval(settings(heartbeat_interval=0), "postgresql://h/o") is None
    assert study.heartbeat_interval(settings(heartbeat_interval=5), "sqlite:///x.db") == 5
    with pytest.raises(ConfigError, match="journal storage .* keeps no heartbeats"):
        study.heartbeat_interval(settings(heartbeat_interval=5), "/runs/study.journal")


# ----------------------------------------------------------------------------- pruners
# Each trial's job reports a loss curve through the real OptunaPruning action, which loads
# the trial from the storage as a training run does; only the training is replaced by a
# closed-form curve: loss(step) = (x - 0.3)^2 + 1 / step.


def curve_job(overrides: list[str], number: int) -> dict:
    from types import SimpleNamespace

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from capibara_exp.sweeping.pruning import OptunaPruning

    parsed = OverridesParser.create().parse_overrides(overrides)
    args = {o.get_key_element(): o.value() for o in parsed}
    trial = OmegaConf.to_container(OmegaConf.create({"t": args["sweep_trial"]}), resolve=True)
    action = OptunaPruning(**trial["t"])
    for step in range(1, 9):
        loss = (float(args["x"]) - 0.3) ** 2 + 1 / step
        if action.run(SimpleNamespace(step=step), {"train_eval": {"loss": loss}}):
            break  # pruned: training stops here, as the trainer's action loop does
    return {"loss": loss}


@pytest.mark.parametrize("pruner, options", [
    ("median", {}), ("percentile", {}), ("successive_halving", {}), ("hyperband", {}),
    ("median", {"n_warmup_steps": 3}),  # reaches the jobs: none is pruned before step 3
])
def test_every_pruner_stops_bad_trials_which_keep_their_last_value(
        tmp_path: Path, pruner: str, options: dict) -> None:
    cfg = settings(n_trials=8, pruner=pruner, pruner_options=options,
                   params={"x": "interval(0, 6)"},
                   storage=str(tmp_path / "study.journal"))  # a file: quicker to open than SQLite
    xs = [0.3, 0.35, 2.0, 0.32, 3.0, 4.0, 5.0, 6.0]  # two good trials first, then mostly bad
    s = study.open_study(cfg, cfg.storage, search_space.parse(["x=interval(0, 6)"])).study
    for x in xs:
        s.enqueue_trial({"x": x})
    s = study.run(cfg, curve_job, tmp_path)
    assert [t.params["x"] for t in s.trials] == xs
    pruned = [t for t in s.trials if t.state == TrialState.PRUNED]
    assert pruned, [(t.params["x"], t.state.name) for t in s.trials]
    assert all(t.params["x"] >= 2.0 for t in pruned)  # only bad trials
    for t in pruned:
        last = max(t.intermediate_values)
        assert last < 8 and t.user_attrs[study.PRUNED_AT] == last  # stopped early
        assert last >= options.get("n_warmup_steps", 1)  # Optuna: no pruning before warm-up
        assert t.value == t.intermediate_values[last]  # and keeps its last value
    assert s.trials[0].state == s.trials[1].state == TrialState.COMPLETE


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
    assert "trial 2 pruned at step " in out.stderr, out.stderr[-3000:]
    assert "3 trials (2 complete, 1 pruned, 0 failed)" in out.stderr
    assert "best command: capibara-exp" in out.stderr
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
    # The best trial's command composes that trial: its rate, and the sweep's fixed overrides.
    best_args = results["best_command"].split()[1:]
    out = subprocess.run([sys.executable, "-m", "capibara_exp.cli", *best_args, "--cfg", "job"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["schedule"]["base_learning_rate"] == results["best_params"][
        "schedule.base_learning_rate"]
    assert cfg["trainer"]["train_steps"] == 6 and cfg["model"]["emb_dim"] == 32
    assert cfg["data_dir"] == str(data_dir) and cfg["trainer"]["stats_period"] == 1  # debug=fast
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
        "trainer.num_microbatches=2",
        "data.batch_size=choice(4, 3)",  # 3 does not split into 2 microbatches: fails at run
    )
    assert out.returncode == 0, out.stderr[-3000:]
    s = optuna.load_study(
        study_name="dense_tiny_lm", storage=f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}"
    )
    states = {t.params["data.batch_size"]: t for t in s.trials}
    assert states[4].state == TrialState.COMPLETE
    assert states[3].state == TrialState.FAIL
    assert "num_microbatches=2" in states[3].user_attrs[study.ERROR]
    assert re.search(r"trial \d failed: ", out.stderr)
    assert "1 complete, 0 pruned, 1 failed" in out.stderr


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


# Options that let each sampler leave its random start-up within a few trials.
MODEL_AFTER = {"tpe": {"n_startup_trials": 2}, "cmaes": {"n_startup_trials": 2},
               "gp": {"n_startup_trials": 2}, "nsgaii": {"population_size": 2}, "random": {}}


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "gp", "nsgaii"])
def test_every_sampler_drives_a_study(tmp_path: Path, sampler: str) -> None:
    """Each sampler runs real trials past its start-up into model-based sampling, or (gp
    without PyTorch) says what to install."""
    import importlib.util

    def job(overrides, number):
        p = dict(o.split("=") for o in overrides)
        return {"loss": (float(p["x"]) - 0.3) ** 2 + (float(p["y"]) - 0.6) ** 2}

    cfg = settings(n_trials=5, sampler=sampler, sampler_options=MODEL_AFTER[sampler],
                   params={"x": "interval(0, 1)", "y": "interval(0, 1)"},
                   storage=str(tmp_path / "study.journal"))
    run = lambda: study.run(cfg, job, tmp_path)  # noqa: E731
    if sampler == "gp" and importlib.util.find_spec("torch") is None:
        with pytest.raises(ConfigError, match=r"sampler=gp needs torch.*capibara-exp\[gp\]"):
            run()
        return
    s = run()
    assert [t.state for t in s.trials] == [TrialState.COMPLETE] * 5
    if sampler == "nsgaii":  # a genetic sampler: children of generation 0 (crossover may
        # copy a parent's value, so values can repeat)
        assert max(t.system_attrs.get("NSGAIISampler:generation", 0) for t in s.trials) >= 1
        return
    assert len({t.params["x"] for t in s.trials}) == 5
    if sampler != "random":  # its model proposes the next trial's values together
        xy = study.search_space(cfg, ())
        asked = study._ask(study.open_study(cfg, cfg.storage, xy), xy)
        assert set(asked.relative_params) == {"x", "y"}


def test_sampler_and_pruner_options_are_set_on_the_command_line() -> None:
    cfg = composed(["hydra/sweeper=capibara_optuna", "hydra.sweeper.pruner=median",
                    "hydra.sweeper.pruner_options={n_warmup_steps: 40}",
                    "hydra.sweeper.sampler_options={n_startup_trials: 3}"], hydra=True)
    cfg = study.SweepSettings(**sweeper_settings(cfg.hydra.sweeper))
    pruner = optuna_study.make_pruner(cfg.pruner, cfg.pruner_options, key=study.PRUNER_KEY)
    assert pruner._n_warmup_steps == 40
    assert cfg.sampler_options == {"n_startup_trials": 3}


def test_sampler_and_pruner_options_are_checked_by_optuna(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sampler_options \{'n_startup': 2\} for sampler=tpe"):
        study.run(settings(sampler="tpe", sampler_options={"n_startup": 2}), quadratic, tmp_path)
    with pytest.raises(ConfigError, match=r"pruner_options \{'warmup': 2\} for pruner=median"):
        study.run(settings(pruner="median", pruner_options={"warmup": 2}), quadratic, tmp_path)


# ----------------------------------------------------------------------------- input reuse


def test_trials_in_one_process_replay_the_batches_a_new_pipeline_makes(
        corpus_data: Path) -> None:
    import numpy as np
    import seqio

    from capibara_exp.runtime import inputs
    from capibara_exp.runtime.utils import DatasetConfig

    cfg = DatasetConfig("capibara_bytes_lm", {"targets": 32}, "train", 4, True, None,
                        pack=True, module="capibara_exp.data.tasks")
    conv = seqio.DecoderFeatureConverter

    def take(n: int, seed: int | None = 7, skip: int = 0) -> list[dict]:
        it = inputs.batches(cfg, conv, seed, skip_batches=skip)
        return [next(it) for _ in range(n)]

    fresh = take(6)  # sharing is off: a new pipeline
    inputs.share_across_runs()
    try:
        first = take(3)  # a first trial: a new pipeline, its batches kept
        resumed = take(5, skip=1)  # a later one resuming at batch 1: 2 kept, then 3 more made
        again = take(1, skip=5)
        other_seed, unseeded, unseeded_again = take(1, seed=8), take(1, None), take(1, None)
    finally:
        inputs.share_across_runs(False)
    for got, want in [(first, fresh[:3]), (resumed, fresh[1:6]), (again, fresh[5:6])]:
        assert [sorted(b) for b in got] == [sorted(b) for b in want]
        for b, w in zip(got, want, strict=True):
            for k in w:
                np.testing.assert_array_equal(b[k], w[k], err_msg=k)
    # Replayed, not remade: the kept batches themselves, read-only for every run.
    assert resumed[0] is first[1] and resumed[1] is first[2] and again[0] is resumed[4]
    assert not first[0]["decoder_target_tokens"].flags.writeable
    # Another seed is another stream; an unseeded shuffle is never replayed.
    assert not np.array_equal(other_seed[0]["decoder_target_tokens"],
                              fresh[0]["decoder_target_tokens"])
    assert unseeded[0] is not unseeded_again[0]


def test_a_retry_runs_in_its_trials_run_dir_and_resumes_there(tmp_path: Path) -> None:
    """A dead process's trial is retried in the run dir it had (the job resumes from its
    checkpoints there); a retry whose run dir is unreachable from here gets its own."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    url = study.storage_url(None, tmp_path)
    x = search_space.parse(["x=interval(0, 1)"])
    opened = study.open_study(settings(), url, x)
    kept_dir = tmp_path / "shared" / "0"
    kept_dir.mkdir(parents=True)
    for number, where in ((0, kept_dir), (1, tmp_path / "another-machine" / "1")):
        trial = study._ask(opened, x)
        assert trial.number == number
        trial.set_user_attr("host", os.uname().nodename)
        trial.set_user_attr("pid", int(dead.stdout))
        trial.set_user_attr("run_dir", str(where))
    subdirs: dict[int, str] = {}

    def job(overrides, number):
        subdirs[number] = next(o.split("=", 1)[1] for o in overrides
                               if o.startswith("hydra.sweep.subdir="))
        return quadratic(overrides, number)

    s = study.run(settings(n_trials=2), job, tmp_path)
    retries = {t.system_attrs["failed_trial"]: t.number for t in s.trials
               if "failed_trial" in t.system_attrs}
    assert sorted(retries) == [0, 1] and len(study.counted(s)) == 2
    assert subdirs[retries[0]] == str(kept_dir)  # resumes where trial 0 ran
    assert subdirs[retries[1]] == str(tmp_path.absolute() / str(retries[1]))
    assert s.trials[retries[1]].user_attrs["run_dir"] == subdirs[retries[1]]


def test_a_preempted_trial_is_retried_not_failed(tmp_path: Path) -> None:
    """A job preempted in this process (it saved its step; errors.Preempted, exit 75) ends
    the worker with 75 after its trial is failed as preempted and retried; the next run
    runs the retry first, and the preemption counts neither toward n_trials nor as a
    failure."""
    from capibara_exp.base.errors import PREEMPTED_EXIT_CODE, Preempted

    def preempted_once(overrides, number):
        if number == 1:
            raise Preempted("SIGTERM: saved step 40")
        return quadratic(overrides, number)

    cfg = settings(n_trials=3, max_failure_rate=0.0)
    with pytest.raises(SystemExit) as stop:
        study.run(cfg, preempted_once, tmp_path)
    assert stop.value.code == PREEMPTED_EXIT_CODE
    s = study.run(cfg, preempted_once, tmp_path)  # the restart
    assert s.trials[1].state == TrialState.FAIL
    assert s.trials[1].user_attrs[study.ERROR] == study.PREEMPTED
    (retry,) = [t for t in s.trials if t.system_attrs.get("failed_trial") == 1]
    assert retry.number == 2 and retry.state == TrialState.COMPLETE
    assert retry.params == s.trials[1].params
    assert [t.state for t in study.counted(s)] == [TrialState.COMPLETE] * 3
