"""Hydra finds sweepers only in the hydra_plugins package: this is the thin shell.

Hydra imports every hydra_plugins module at start-up, so nothing heavy is imported here;
the work is in capibara_exp.sweeping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper

IN_PROCESS = "basic"  # Hydra's launcher that runs each job in this process


class CapibaraOptunaSweeper(Sweeper):
    """hydra/sweeper=capibara_optuna: an Optuna study whose trials are Hydra jobs.

    Under Hydra's in-process launcher (hydra/launcher=basic) it runs one trial at a time and
    starts n_workers - 1 more processes; under another launcher (joblib, submitit, Ray) it
    hands the launcher up to n_workers trials at once, which the launcher runs in parallel."""

    def __init__(self, **settings: Any):
        self.settings = settings

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        import sys

        from omegaconf import OmegaConf

        from capibara_exp.sweeping import study as study_lib
        from capibara_exp.sweeping import workers

        settings = study_lib.SweepSettings(**OmegaConf.to_container(
            OmegaConf.create(self.settings), resolve=True))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        # Hydra's in-process launcher (the config group option hydra/launcher=basic, Hydra's
        # default) composes the job's config at once, raising what a check would; a check
        # first (for launchers that compose elsewhere, later) would compose every trial's
        # config twice.
        in_process = self.config.hydra.runtime.choices.get("hydra/launcher") == IN_PROCESS

        def launch(overrides: list[str], number: int) -> Any:
            (job,) = self.launcher.launch([overrides], initial_job_idx=number)
            return job.return_value  # re-raises the job's exception

        def launch_batch(jobs: list[tuple[list[str], int]]) -> list[Any]:
            """Another launcher (joblib, submitit, Ray) runs the batch's jobs in parallel."""
            batch = [overrides for overrides, _ in jobs]
            self.validate_batch_is_legal(batch)
            returns = self.launcher.launch(batch, initial_job_idx=jobs[0][1])
            return [_outcome(job) for job in returns]

        procs: list = []

        def start_workers() -> None:
            if in_process:  # other launchers run n_workers jobs at once themselves
                procs.extend(workers.start(sys.argv[1:], settings.n_workers, sweep_dir))

        # The composed config's groups: the best trial's experiment file sets them through its
        # defaults list, not as values.
        groups = list(self.config.hydra.runtime.choices)
        try:
            study = study_lib.run(settings, launch, sweep_dir, arguments, on_open=start_workers,
                                  write=False, report=_say,
                                  batch=1 if in_process else settings.n_workers,
                                  launch_batch=None if in_process else launch_batch)
        except BaseException:
            workers.stop(procs)
            raise
        workers.wait(procs, sweep_dir)
        # Once the study is done (every worker waits for its peers' trials): the workers this
        # sweep started share its sweep dir and leave the results to it; a worker started on
        # another machine (worker_index 0 there too) writes the same results from the storage.
        if settings.worker_index == 0:
            fixed = study_lib.search_space(settings, arguments).fixed
            results = study_lib.write_results(study, settings, sweep_dir, fixed, groups)
            for line in study_lib.summary(results, sweep_dir):
                _say(line)
        return study


def _outcome(job: Any) -> Any:
    """A launched job's return value, or the exception it raised."""
    try:
        return job.return_value
    except Exception as err:
        return err


def _say(line: str) -> None:
    import sys

    print(f"capibara-exp: {line}", file=sys.stderr, flush=True)
