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
    """hydra/sweeper=capibara_optuna: an Optuna study whose trials are Hydra jobs."""

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
            if not in_process:
                self.validate_batch_is_legal([overrides])
            (job,) = self.launcher.launch([overrides], initial_job_idx=number)
            return job.return_value  # re-raises the job's exception

        procs: list = []

        def start_workers() -> None:
            procs.extend(workers.start(sys.argv[1:], settings.n_workers, sweep_dir))

        # The composed config's groups: the best trial's experiment file sets them through its
        # defaults list, not as values.
        groups = list(self.config.hydra.runtime.choices)
        try:
            study = study_lib.run(settings, launch, sweep_dir, arguments, on_open=start_workers,
                                  write=False, report=_say)
        except BaseException:
            workers.stop(procs)
            raise
        workers.wait(procs, sweep_dir)
        # Once, when the workers have finished their trials too; the workers this sweep
        # started share its sweep dir and leave the results to it.
        if settings.worker_index == 0:
            fixed = study_lib.search_space(settings, arguments).fixed
            results = study_lib.write_results(study, settings, sweep_dir, fixed, groups)
            for line in study_lib.summary(results, sweep_dir):
                _say(line)
        return study


def _say(line: str) -> None:
    import sys

    print(f"capibara-exp: {line}", file=sys.stderr, flush=True)
