"""engine=tpu_vm's launch script restarts its job: a fake gcloud runs the worker command here,
and a fake worker dies (kill -9), is preempted (exit 75) or fails on its config (exit 2)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from capibara_exp.base.errors import ConfigError
from capibara_exp.data import corpus
from tests.fakes import executable, fake_slice, launch_script

# The worker's "python": each start appends a line; the n-th start does what FATES[n] says.
FAKE_WORKER = r"""#!/usr/bin/env bash
n=$(wc -l < "$FAKE_SLICE_DIR/starts" 2>/dev/null || echo 0)
echo "start $n: $*" >> "$FAKE_SLICE_DIR/starts"
fate=$(sed -n "$((n + 1))p" "$FAKE_SLICE_DIR/fates")
case "$fate" in
  kill) kill -9 $$;;
  *) exit "$fate";;
esac
"""


def run_launch(tmp_path: Path, fates: list[str], **engine) -> tuple[subprocess.CompletedProcess,
                                                                    list[str], str]:
    env = fake_slice(tmp_path)
    (tmp_path / "fates").write_text("\n".join(fates) + "\n")
    worker = executable(tmp_path / "fake_python", FAKE_WORKER)
    gin = tmp_path / "config.gin"
    gin.write_text("# a config.gin\n")
    script = launch_script(tmp_path, gin, tmp_path / "shared" / "run", str(worker), **engine)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    starts = (tmp_path / "starts").read_text().splitlines()
    log = (tmp_path / "launch_tpu_vm.log").read_text() if (
        tmp_path / "launch_tpu_vm.log").exists() else ""
    return done, starts, log


@pytest.mark.slow
def test_a_killed_and_a_preempted_worker_are_restarted_with_growing_waits(tmp_path) -> None:
    done, starts, log = run_launch(tmp_path, ["kill", "75", "kill", "0"], max_restarts=3,
                                   restart_backoff_s=1, restart_backoff_max_s=2)
    assert done.returncode == 0, done.stderr
    assert len(starts) == 4 and all("-m capibara_exp.runtime" in s for s in starts)
    assert (tmp_path / "shared" / "torture" / "run" / "config.gin").is_file()  # copied first
    restarts = re.findall(r"job (failed|was preempted) \(exit (\d+)\); restart (\d) of 3 in "
                          r"(\d+)s, resuming from the newest verified checkpoint in ", log)
    assert restarts == [("failed", "137", "1", "1"), ("was preempted", "75", "2", "2"),
                        ("failed", "137", "3", "2")]  # waits double, up to the cap
    assert log.rstrip().endswith("job finished")


def test_restarts_are_bounded_and_a_config_error_is_not_retried(tmp_path) -> None:
    done, starts, log = run_launch(tmp_path / "bounded", ["kill", "kill", "kill"],
                                   max_restarts=1, restart_backoff_s=0)
    assert done.returncode == 137 and len(starts) == 2
    assert "job failed (exit 137) and 1 of 1 restarts are used: giving up" in log
    done, starts, log = run_launch(tmp_path / "config", ["2", "0"], max_restarts=3,
                                   restart_backoff_s=0)
    assert done.returncode == 2 and len(starts) == 1
    assert "configuration error (exit 2): not restarted" in log
    done, starts, _ = run_launch(tmp_path / "never", ["75", "0"], max_restarts=0,
                                 restart_backoff_s=0)
    assert done.returncode == 75 and len(starts) == 1


@pytest.mark.parametrize("key, value, message", [
    ("max_restarts", -1, "engine.max_restarts must be an integer >= 0, got -1"),
    ("restart_backoff_s", 1.5, "engine.restart_backoff_s must be an integer >= 0, got 1.5"),
    ("restart_backoff_max_s", 5, "engine.restart_backoff_max_s=5 is below "
                                 "engine.restart_backoff_s=30"),
])
def test_restart_settings_are_checked(tmp_path, key, value, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch_script(tmp_path, tmp_path / "config.gin", tmp_path / "shared" / "run", "python",
                      **{key: value})


# The worker's "python" for the data build: the data console script runs for real (this
# interpreter), the job only records that it started.
BUILDING_WORKER = r"""#!/usr/bin/env bash
if [ "$1 $2" = "-m capibara_exp.cli.data" ]; then
  echo "build: $*" >> "$FAKE_SLICE_DIR/starts"; exec "$REAL_PYTHON" "$@"
fi
echo "job: $*" >> "$FAKE_SLICE_DIR/starts"
"""


@pytest.mark.parametrize("datasets, code", [(("bytes_lm",), 0), (("no_such_data",), 2)])
def test_worker_0_builds_what_the_run_reads_before_the_job(tmp_path, datasets, code) -> None:
    """The workers only read the data: worker 0 builds it into the shared data dir first
    (capibara-exp-data, for real); a build that fails on its input stops the launch."""
    env = dict(fake_slice(tmp_path), REAL_PYTHON=sys.executable)
    worker = executable(tmp_path / "fake_python", BUILDING_WORKER)
    gin = tmp_path / "config.gin"
    gin.write_text("# a config.gin\n")
    script = launch_script(tmp_path, gin, tmp_path / "shared" / "run", str(worker),
                           builds=datasets)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == code, done.stderr[-2000:]
    starts = (tmp_path / "starts").read_text().splitlines()
    data_dir = tmp_path / "shared" / "data"
    assert starts[0] == (f"build: -m capibara_exp.cli.data data_dir={data_dir} "
                         f"datasets=[{datasets[0]}]")
    if code == 0:
        assert len(starts) == 2 and starts[1].startswith("job: -m capibara_exp.runtime")
        assert (corpus.corpus_dir(data_dir) / "manifest.json").is_file()
    else:
        assert len(starts) == 1 and "no_such_data" in done.stderr
        assert not data_dir.exists() or not any(data_dir.iterdir())
