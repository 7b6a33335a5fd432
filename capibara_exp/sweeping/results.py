"""What a sweep leaves and says at its end: optimization_results.yaml, the best trial as an
experiment file, plots, and a closing summary on the console."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from capibara_exp.base import atomic
from capibara_exp.base.errors import ConfigError
from capibara_exp.sweeping import best as best_lib
from capibara_exp.sweeping.settings import SweepSettings

log = logging.getLogger(__name__)
RESULTS = "optimization_results.yaml"
NOT_RUN = "not_run"  # asked by a worker that lost the race for the study's last trial
RETRIED = "retried"  # a failed trial (dead machine, preempted) whose copy runs again


def counted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's started trials, less those asked by a worker that lost the race for the
    last one and those retried (their retry counts instead). Enqueued (WAITING) trials
    count once a worker asks for them: ask() runs them first."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state != TrialState.WAITING and NOT_RUN not in t.user_attrs
            and not (t.state == TrialState.FAIL and t.user_attrs.get(RETRIED))]



def write_results(study: optuna.Study, settings: SweepSettings, sweep_dir: Path,
                  fixed: Sequence[str] = (), groups: Sequence[str] = ()) -> dict:
    """optimization_results.yaml and the best trial as an experiment file (best.write: the
    fixed overrides `fixed` and the config groups `groups` go into it)."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    trials = counted(study)
    counts = {s.name.lower(): sum(t.state == s for t in trials)
              for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    results: dict[str, Any] = {"name": "capibara_optuna", "study_name": study.study_name,
                               "directions": settings.directions, "metrics": settings.metrics,
                               "trials": counts}
    if complete and len(settings.directions) == 1:
        best = study.best_trial
        results.update(best_params=dict(best.params), best_value=best.value,
                       best_trial=best.number)
        try:
            path, command = best_lib.write(sweep_dir, settings.study_name, best.number,
                                           best.value, fixed, best.params, groups)
            results.update(best_experiment=str(path), best_command=command)
        except ConfigError as err:  # the results themselves must still be written
            log.warning("best trial's experiment file not written: %s", err)
            results["best_experiment"] = f"not written: {err}"
    elif complete:
        results["pareto_front"] = [{"trial": t.number, "params": dict(t.params),
                                    "values": list(t.values)} for t in study.best_trials]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    from capibara_exp.sweeping.study_plots import write_plots  # matplotlib, only once a sweep ends

    results["plots"] = write_plots(study, sweep_dir)
    atomic.write_text(sweep_dir / RESULTS, yaml.safe_dump(results, sort_keys=False))
    return results


def summary(results: dict[str, Any], sweep_dir: Path) -> list[str]:
    """The closing lines of a sweep: trial counts, the best value, parameters and command
    (or the Pareto front's size), and where the results are."""
    counts = results["trials"]
    lines = [f"sweep {sweep_dir}: {sum(counts.values())} trials ({counts['complete']} complete, "
             f"{counts['pruned']} pruned, {counts['fail']} failed)"]
    metric = results["metrics"][0] if len(results["metrics"]) == 1 else results["metrics"]
    if "best_value" in results:
        params = " ".join(f"{k}={_short(v)}" for k, v in results["best_params"].items())
        lines.append(f"best {metric} {results['best_value']:.6g} (trial "
                     f"{results['best_trial']}): {params}")
        if "best_command" in results:
            lines.append(f"best command: {results['best_command']}")
    elif "pareto_front" in results:
        lines.append(f"Pareto front of {metric}: {len(results['pareto_front'])} trial(s)")
    else:
        lines.append("no trial completed: no best value")
    lines.append(f"results: {sweep_dir / RESULTS}")
    return lines


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
