"""The console scripts as a user runs them, around one real (tiny) run: every command given
that run as an input leaves its tree as it was (hashes and mtimes of every file and dir),
whether it succeeds or is refused; a refusal writes no output; SIGTERM while a run starts,
compiles or restores is status 75 and one line; a full disk is one line, exit 1, with the
newest checkpoint intact; damaged metrics lines do not stop a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.console_lines import error_lines
from tests.snapshots import snapshot

TINY = ["debug=fast", "model.emb_dim=32", "model.mlp_dim=64", "data.batch_size=4"]
SCRIPT = {"main": "capibara_exp.cli.main", "merge": "capibara_exp.cli.merge",
          "plot": "capibara_exp.cli.plot", "lora": "capibara_exp.cli.lora",
          "convert": "capibara_exp.cli.convert"}


def call(script: str, *args: str, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    program = (f"import sys; sys.argv[0] = 'capibara-exp-{script}'\n"
               f"from {SCRIPT[script]} import main\nmain()\n")
    return subprocess.run([sys.executable, "-c", program, *args], cwd=cwd, text=True,
                          capture_output=True, timeout=600, **kwargs)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """A finished tiny run (checkpoints 2 and 4, metrics, config.gin)."""
    root = tmp_path_factory.mktemp("inputs")
    out = call("main", *TINY, f"data_dir={data_dir}", f"model_dir={root / 'run'}", cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "run"


CASES = [
    # (script, args, exit status, what must not exist afterwards)
    ("merge", ["runs={run}", "out={run}"], 2, None),
    ("merge", ["runs=[{run}]", "out={run}/merged"], 2, "{run}/merged"),
    ("merge", ["runs=[{run}]", "last_k=999", "out={tmp}/merged"], 2, "{tmp}/merged"),
    ("merge", ["runs=[{run}/checkpoint_2,{run}/checkpoint_4]", "out="], 2, None),
    ("lora", ["export", "run_dir={run}", "out={run}/exported"], 2, "{run}/exported"),
    ("convert", ["export", "checkpoint={run}", "out={run}/hf"], 2, "{run}/hf"),
    ("main", [*TINY, "model_dir={run}", "--gin.TRAIN_STEPS=-5"], 2, None),
    ("main", [*TINY, "model_dir={run}", "--gin.BASE_LEARNING_RATE=1e30"], 2, None),
    ("plot", ["{run}"], 0, None),
]


@pytest.mark.parametrize("script, args, status, absent", CASES,
                         ids=[f"{c[0]} {' '.join(c[1])[:40]}" for c in CASES])
def test_an_input_run_is_never_changed(script, args, status, absent, run: Path,
                                       tmp_path: Path, data_dir: Path) -> None:
    before = snapshot(run)
    args = [a.format(run=run, tmp=tmp_path) for a in args]
    if script == "main":
        args.append(f"data_dir={data_dir}")
    out = call(script, *args, cwd=tmp_path)
    assert out.returncode == status, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    if status == 2:  # one line, after the progress of a command that started
        assert len(error_lines(out.stderr)) == 1, out.stderr
    assert snapshot(run) == before
    if absent:
        assert not Path(absent.format(run=run, tmp=tmp_path)).exists()
    if script == "plot":
        assert (tmp_path / "run_curves.png").is_file()


def _until(proc: subprocess.Popen, marker: str) -> list[str]:
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"the run ended before {marker!r}: {''.join(seen)[-2000:]}")


@pytest.mark.parametrize("moment", ["compiling", "restored"])
def test_sigterm_while_compiling_or_restoring_is_75_and_one_line(moment: str, run: Path,
                                                                  tmp_path: Path,
                                                                  data_dir: Path) -> None:
    model_dir = tmp_path / "resumed"
    if moment == "restored":  # a resume: the run's checkpoints, copied (the input is kept)
        subprocess.run(["cp", "-a", str(run), str(model_dir)], check=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "capibara_exp.cli", *TINY, f"data_dir={data_dir}",
         f"model_dir={model_dir}", "trainer.train_steps=6"],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        _until(proc, "compiling" if moment == "compiling" else "run dir")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=300) == 75, rest
    finally:
        proc.kill()
    last = lines(rest)[-1]
    assert "by SIGTERM" in last and "run the same command again" in last, rest
    assert "Traceback" not in rest


def test_a_full_disk_is_one_line_and_the_newest_checkpoint_is_kept(run: Path, tmp_path: Path,
                                                                   data_dir: Path) -> None:
    """metrics.jsonl on a device that is always full (/dev/full): ENOSPC at the first
    record; one line naming the file and the failure, exit 1; the checkpoints as they were."""
    model_dir = tmp_path / "full"
    subprocess.run(["cp", "-a", str(run), str(model_dir)], check=True)
    (model_dir / "metrics.jsonl").unlink()
    os.symlink("/dev/full", model_dir / "metrics.jsonl")
    kept = snapshot(model_dir / "checkpoint_4")
    out = call("main", *TINY, f"data_dir={data_dir}", f"model_dir={model_dir}",
               "trainer.train_steps=6", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    last = lines(out.stderr)[-1]
    assert "No space left on device (ENOSPC)" in last and "checkpoint_" in last, out.stderr
    assert "Traceback" not in out.stderr
    assert snapshot(model_dir / "checkpoint_4") == kept


def test_a_resume_over_damaged_metrics_lines_says_so_once_and_trains_on(
        run: Path, tmp_path: Path, data_dir: Path) -> None:
    """A metrics.jsonl with binary garbage and a line cut mid-record (a crash, a full disk):
    the resume trains on, says once how many lines it left out, and appends after them."""
    model_dir = tmp_path / "damaged"
    subprocess.run(["cp", "-a", str(run), str(model_dir)], check=True)
    with (model_dir / "metrics.jsonl").open("ab") as out:
        out.write(b"\xff\xfe garbage\n{\"step\": 5, \"spl")
    out = call("main", *TINY, f"data_dir={data_dir}", f"model_dir={model_dir}",
               "trainer.train_steps=6", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("damaged line(s) left out") == 1, out.stderr
    from capibara_exp.runtime.metrics import last_metrics

    assert last_metrics(model_dir, "train")["step"] == 6


def test_a_disk_that_fills_while_a_checkpoint_is_saved_is_one_line(tmp_path: Path,
                                                                   data_dir: Path) -> None:
    """A 300 KB file system (a tmpfs; mounting one needs root): the first checkpoint does
    not fit. orbax's threads fail one after another; the console shows one line, exit 1,
    and no half-written checkpoint is left as a checkpoint."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small file system needs mount rights: {mounted.stderr.strip()}")
    try:
        out = call("main", *TINY, f"data_dir={data_dir}", f"model_dir={disk / 'run'}",
                   cwd=tmp_path)
        assert out.returncode == 1, out.stderr[-3000:]
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        last = lines(out.stderr)[-1]
        # which write fails first varies (a metrics line, the checkpoint's writer threads)
        assert "No space left on device" in last and "(ENOSPC)" in last, out.stderr
        assert str(disk / "run") in last
        finished = [p.name for p in (disk / "run").iterdir()
                    if p.name.startswith("checkpoint_") and p.name[11:].isdigit()]
        assert not finished  # the half-written one keeps orbax's -tmp name: no resume reads it
    finally:
        subprocess.run(["umount", str(disk)], check=False)
