"""The sweeper under Hydra's parallel launchers: a batch of n_workers trials handed to
joblib and to submitit (its local executor), real training jobs reporting to the pruner from
their own processes while the sweeper keeps their heartbeats."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from capibara_exp.sweeping import study

ROOT = Path(__file__).resolve().parents[1]


def sweep(tmp_path: Path, data_dir: Path, launcher: list[str]) -> tuple[optuna.Study, str]:
    """The command docs/sweeps.md gives for a parallel launcher, on a tiny model."""
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "capibara_exp.cli", "-m", "hydra/sweeper=capibara_optuna",
           *launcher, "hydra.sweeper.n_workers=2", "hydra.sweeper.n_trials=2",
           "hydra.sweeper.sampler=random", "hydra.sweeper.pruner=median",
           # heartbeats on SQLite too, with a grace far below a job's length: a trial whose
           # heartbeat stopped while its job ran elsewhere would be failed as stale
           "hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.grace_period=3",
           "debug=fast", "trainer.train_steps=4", "trainer.eval_period=2", "model.emb_dim=32",
           "model.mlp_dim=64", "data.batch_size=4", f"data_dir={data_dir}",
           f"hydra.sweep.dir={sweep_dir}", "schedule.base_learning_rate=interval(1e-3, 1e-2)"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    s = optuna.load_study(study_name="dense_tiny_lm",
                          storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    trials = study.counted(s)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, out.stderr[-3000:]
    for t in trials:
        assert Path(t.user_attrs["run_dir"]) == sweep_dir.absolute() / str(t.number)
        assert (sweep_dir / str(t.number) / "config.gin").is_file()
        assert sorted(t.intermediate_values) == [2, 4]  # reported from inside the job
    assert "capibara-exp: trials 0, 1 launched together" in out.stderr
    assert (sweep_dir / study.RESULTS).is_file() and not (sweep_dir / "workers").exists()
    return s, out.stderr


@pytest.mark.slow
def test_joblib_runs_a_batch_of_trials_in_parallel(tmp_path: Path, data_dir: Path) -> None:
    sweep(tmp_path, data_dir, ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"])


@pytest.mark.slow
def test_submitit_local_runs_a_batch_of_trials(tmp_path: Path, data_dir: Path) -> None:
    sweep(tmp_path, data_dir, ["hydra/launcher=submitit_local",
                               "hydra.launcher.timeout_min=20"])
    assert list((tmp_path / "sweep" / ".submitit").glob("*/*_result.pkl"))  # its jobs ran
