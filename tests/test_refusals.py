"""Every traceback and silent acceptance of issue #24, each a case: one line naming the key,
flag or path, exit status 2, nothing written (the sandbox's tree is the same after).

They run through the console scripts' own `main` in this process; a command line that
passed the checks would reach Hydra's job, which here fails the test instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from capibara_exp.cli import data as data_cli
from capibara_exp.cli import main as cli
from capibara_exp.cli import merge as merge_cli
from capibara_exp.cli import plot as plot_cli
from tests.console_lines import error_lines
from tests.snapshots import snapshot

LONG = "x" * 300


def _sandbox(root: Path) -> dict[str, Path]:
    """Files the cases name: a file, a run dir, gin files, a --config-dir with bad YAML."""
    (root / "afile").write_text("not a dir\n")
    run = root / "RUN"
    (run / "checkpoint_12").mkdir(parents=True)
    (run / "checkpoint_12" / "capibara_manifest.json").write_text('{"kind": "final"}\n')
    (run / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 2.0}\n')
    (root / "bin.gin").write_bytes(bytes(range(256)) * 2)
    (root / "u16.gin").write_text("TRAIN_STEPS = 3\n", encoding="utf-16")
    conf = root / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "model").mkdir()
    (conf / "experiment" / "selfref.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /experiment/selfref\n")
    (conf / "model" / "dup.yaml").write_text("emb_dim: 32\nemb_dim: 64\n")
    (conf / "model" / "broken.yaml").write_text("emb_dim: [64\n")
    (conf / "experiment" / "binary.yaml").write_bytes(b"\xff\xfe\x00binary")
    (root / "primary").mkdir()
    (root / "primary" / "config.yaml").write_text("a: [1\n")
    (root / "plotdir").mkdir()
    return {"file": root / "afile", "run": run, "conf": conf}


MAIN_CASES = [
    # empty and escaping paths
    (["model_dir="], "model_dir= (set by the command line): expected a path (not empty"),
    (["name=a/b/../../c"], "name=a/b/../../c"),
    (["model_dir={file}"], "model_dir={file}: is a file, not a directory"),
    (["model_dir={file}/run"], "{file} is a file, not a directory"),
    (["model_dir=/proc/1/no_such_dir"], "cannot be written"),
    ([f"model_dir={{root}}/{LONG}"], "a path component of 300 bytes"),
    (["data_dir={file}"], "data_dir={file}: is a file"),
    (["data_dir="], "data_dir= (set by the command line): expected a path"),
    # gin flags through the schema
    (["--gin.TRAIN_STEPS=-5"], "--gin.TRAIN_STEPS=-5 sets trainer.train_steps=-5: expected an "
                               "integer >= 1"),
    (["--gin.BASE_LEARNING_RATE=1e30"], "--gin.BASE_LEARNING_RATE=1e30 sets "
                                        "schedule.base_learning_rate=1e30: expected a number"),
    (["gin_bindings=['TRAIN_STEPS = 0']"], "gin_bindings[0] sets trainer.train_steps=0"),
    (["--gin.TRAN_STEPS=5"], "--gin.TRAN_STEPS=5: no gin macro TRAN_STEPS in config.gin (gin "
                             "would bind it and nothing read it); did you mean 'TRAIN_STEPS'?"),
    (["--gin.TRAIN_STEPS=" + "9" * 5000], "--gin.TRAIN_STEPS="),
    # files that are not what they claim, defaults that never end
    (["--gin_file={root}/bin.gin"], "bin.gin: not a gin file (not UTF-8 text"),
    (["--gin_file={root}/u16.gin"], "u16.gin: not a gin file (not UTF-8 text"),
    (["--config-dir={conf}", "experiment=selfref"], "include each other without end"),
    (["--config-dir={conf}", "model=broken"], "broken.yaml:2:1: malformed YAML"),
    (["--config-dir={conf}", "model=dup"], "dup.yaml:2:1: malformed YAML: found duplicate key"),
    (["--config-dir={root}/primary"], "primary/config.yaml:2:1: malformed YAML"),
    (["--config-dir={conf}", "model.emb_dm=3"], "did you mean 'model.emb_dim'?"),  # beside
    # a binary file in the --config-dir, which the suggestions do not read
    # what Hydra refuses with a traceback of its own
    (["k" * 5000 + "=1"], "an override key of 5000 characters"),
    (["model.emb_dim=" + "9" * 5000], "model.emb_dim: an integer of 5000 digits"),
    (["engine=null"], "engine=null: a config group takes an option's name, not None"),
    (["engine=64"], "engine=64: a config group takes an option's name, not 64"),
    (["~trainer", "trainer.train_steps=1"], "trainer.train_steps"),
    (["--package=x"], "--package only chooses what --cfg shows"),
    (["--config-dir", "--config-dir"], "--config-dir needs a value"),
    (["--cfg", "job", "--resolve", "~name=null"], "Interpolation key 'name' not found"),
    # Hydra's flags it refuses together (it raised a ValueError: an internal error, exit 1)
    (["--resolve", "~name=null"], "--resolve only changes what --cfg or --help shows"),
    (["-m", "--cfg", "job"], "--multirun and --cfg together"),
    # flags whose arguments Hydra reads itself (its ValueError and UnpicklingError were
    # internal errors, exit 1)
    (["-sc"], "--shell-completion takes one of install=SHELL, uninstall=SHELL, query=SHELL"),
    (["-sc", "install=tcsh"], "install=tcsh: no completion for that shell"),
    (["-sc", "query=bash"], "query=... is what the installed completion runs"),
    (["--experimental-rerun", "{file}"], "--experimental-rerun {file}: not a Hydra job's "
                                         "config.pickle"),
    (["--experimental-rerun={root}/nope"], "--experimental-rerun {root}/nope: No such file"),
    (["--info", "defaults", "-c", "job", "--run"], "--info and --cfg and --run together"),
    # a sweep's settings, before the sweep dir exists
    (["-m", "hydra/sweeper=capibara_optuna", "hydra.sweeper.sampler=rando",
      "trainer.train_steps=choice(2,3)"], "hydra.sweeper.sampler=rando: not one of tpe, random"),
    (["-m", "hydra/sweeper=capibara_optuna"], "define no search dimension"),
]


def _fill(args: list[str], paths: dict[str, Path], root: Path) -> list[str]:
    return [a.format(root=root, **paths) for a in args]


def _run(main, args: list[str], capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as stopped:
        main(args)
    err = capsys.readouterr().err
    return stopped.value.code, error_lines(err)  # a started command's progress left out


def _refuses_in_one_line(main, args: list[str], message: str, tmp_path: Path, monkeypatch,
                         capsys, job=None, extra=()) -> None:
    """Run a console script's main in a fresh sandbox (its job, if named, replaced) on args
    and then `extra`: exit 2, one line holding `message`, the sandbox unchanged."""
    paths = _sandbox(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = [*_fill(args, paths, tmp_path), *extra]
    if job is not None:
        _no_job(monkeypatch, job, args)
    before = snapshot(tmp_path)
    code, lines = _run(main, args, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert message.format(root=tmp_path, **paths) in lines[0], lines[0]
    assert snapshot(tmp_path) == before


def _no_job(monkeypatch, module, args) -> None:
    def job_started() -> None:
        raise AssertionError(f"{args}: passed the checks and reached Hydra's job")

    monkeypatch.setattr(module, "_app", job_started)


@pytest.mark.parametrize("args, message", MAIN_CASES,
                         ids=[" ".join(a)[:50] for a, _ in MAIN_CASES])
def test_capibara_exp_refuses_in_one_line_and_writes_nothing(args, message, tmp_path: Path,
                                                             monkeypatch, capsys) -> None:
    own_dir = any(a.startswith("model_dir=") for a in args) or "-m" in args
    _refuses_in_one_line(cli.main, args, message, tmp_path, monkeypatch, capsys, job=cli,
                         extra=() if own_dir else (f"model_dir={tmp_path}/model",))


MERGE_CASES = [
    (["runs={run}", "out={run}"], "out={run}: overlaps the input runs[0]={run}"),
    (["runs=[{run}]", "out={run}/checkpoint_12/sub"], "overlaps the input runs[0]"),
    (["runs=[{run}]", "out="], "out= (set by the command line): expected a path"),
    (["runs=[{run}]", "out={file}"], "out={file}: exists and is a file"),
    (["runs=[{run}]", "out={root}/merged", "eval_config={root}/nope.gin"],
     "eval_config={root}/nope.gin: no such file"),
    (["runs=[{run}]", "out={run}/../RUN/checkpoint_12"], "overlaps the input runs[0]"),
    (["runs=[{root}/nope]", "out={root}/merged"], "runs[0]={root}/nope: no such file"),
    (["runs=['']", "out={root}/merged"], "runs="),
    (["runs=[{run}]", "base={root}/nope", "out={root}/merged"], "base={root}/nope: no such"),
]


@pytest.mark.parametrize("args, message", MERGE_CASES,
                         ids=[" ".join(a)[:50] for a, _ in MERGE_CASES])
def test_merge_refuses_before_writing(args, message, tmp_path: Path, monkeypatch,
                                      capsys) -> None:
    _refuses_in_one_line(merge_cli.main, args, message, tmp_path, monkeypatch, capsys,
                         job=merge_cli)


@pytest.mark.parametrize("args, message", [
    (["data_dir={file}"], "data_dir={file}: is a file"),
    (["data_dir={root}/new", "inputs.logs=[{root}/nope.jsonl]"], "inputs.logs[0]="),
    (["data_dir={root}/new/deeper", "inputs.logs=[{root}/nope.jsonl]"], "no such file"),
    (["data_dir="], "data_dir= (set by the command line): expected a path"),
])
def test_data_refuses_before_making_data_dir(args, message, tmp_path: Path, monkeypatch,
                                             capsys) -> None:
    _refuses_in_one_line(data_cli.main, args, message, tmp_path, monkeypatch, capsys,
                         job=data_cli)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, message", [
    (["{run}", "--out", "{root}/plotdir"], "--out={root}/plotdir: is a directory"),
    (["{run}", "--out", "{run}/curves.png"], "inside the run dir"),
    (["{root}/nope"], "RUN_DIR={root}/nope: no such file"),
    (["{file}"], "not a directory"),
    ([""], "RUN_DIR=: an empty path"),
    (["{run}", "--colour"], "unrecognized arguments: --colour"),
    ([], "the following arguments are required: run_dir"),
])
def test_plot_refuses_in_one_line(args, message, tmp_path: Path, monkeypatch, capsys) -> None:
    _refuses_in_one_line(plot_cli.main, args, message, tmp_path, monkeypatch, capsys)


def test_plot_writes_beside_not_inside_the_run_and_keeps_an_existing_png(
        tmp_path: Path, monkeypatch, capsys) -> None:
    paths = _sandbox(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_before = snapshot(paths["run"])
    plot_cli.main([str(paths["run"])])
    assert (tmp_path / "RUN_curves.png").stat().st_size > 0
    assert snapshot(paths["run"]) == run_before
    code, lines = _run(plot_cli.main, [str(paths["run"])], capsys)
    assert code == 2 and "exists; --overwrite replaces it" in lines[0]
    plot_cli.main([str(paths["run"]), "--overwrite"])


def test_a_damaged_metrics_line_is_counted_and_left_out(tmp_path: Path, monkeypatch,
                                                        capsys) -> None:
    """A line cut by a crash, binary garbage, a JSON value that is not a record: said once,
    the rest drawn; the file is not changed."""
    from capibara_exp.runtime.metrics import MetricsWriter, last_metrics

    paths = _sandbox(tmp_path)
    metrics = paths["run"] / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1, "split": "train", "loss": 2.0}\n\xff\xfe\x00garbage\n'
                        b'[1, 2]\n{"step": 2, "split": "train", "loss": 1.5}\n{"step": 3, "spl')
    before = snapshot(paths["run"])
    monkeypatch.chdir(tmp_path)
    plot_cli.main([str(paths["run"])])
    err = capsys.readouterr().err
    assert err.count("3 damaged line(s) left out") == 1, err
    assert snapshot(paths["run"]) == before
    assert last_metrics(paths["run"], "train")["step"] == 2
    writer = MetricsWriter(paths["run"])  # a resume appends after the cut line, not onto it
    writer.write(3, "train", {"loss": 1.0})
    writer.close()
    assert last_metrics(paths["run"], "train")["step"] == 3


def test_a_second_run_on_a_locked_model_dir_is_refused_with_pid_and_host(
        tmp_path: Path, monkeypatch, capsys) -> None:
    import socket
    import subprocess

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from capibara_exp.base import run_lock\n"
         f"run_lock.hold({str(tmp_path / 'run')!r}); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.chdir(tmp_path)
        args = [f"model_dir={tmp_path / 'run'}", "debug=fast"]
        _no_job(monkeypatch, cli, args)
        before = snapshot(tmp_path)
        code, lines = _run(cli.main, args, capsys)
        assert code == 2 and len(lines) == 1, lines
        assert f"in use by pid {holder.pid} on host {socket.gethostname()}" in lines[0]
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock is stale, and the next run takes it over with a note
    reached = []
    monkeypatch.setattr(cli, "_app", lambda: reached.append(True))
    cli.main(args)
    err = capsys.readouterr().err
    assert reached and f"took over the stale lock of {tmp_path / 'run'} (pid {holder.pid}" in err
    from capibara_exp.base import run_lock

    run_lock.release(tmp_path / "run" / run_lock.LOCK_NAME)
    assert not (tmp_path / "run" / run_lock.LOCK_NAME).exists()


def test_os_failures_are_one_line_with_the_path(tmp_path: Path, capsys) -> None:
    """An OSError past the checks: one line naming the path and the failure; exit 2 when
    the command line named that path, 1 when it is the environment's."""
    from capibara_exp.cli.shell import console

    full = tmp_path / "full"
    os.symlink("/dev/full", full)

    @console("capibara-test")
    def write(argv: list[str]) -> None:
        with open(argv[0].split("=", 1)[1], "w") as out:
            out.write("x" * 65536)
            out.flush()

    with pytest.raises(SystemExit) as stopped:
        write([f"out={full}"])
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 1 and len(lines) == 1, lines
    assert "No space left on device (ENOSPC)" in lines[0]
    with pytest.raises(SystemExit) as stopped:
        write([f"out={tmp_path / 'afile_missing' / 'x'}"])
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and "No such file or directory (ENOENT)" in lines[0]


def test_a_merge_of_different_models_is_refused_not_a_merge_of_one(tmp_path: Path) -> None:
    """Two checkpoints whose kernels differ in shape: the gate used to reject one and write
    the other as the "merge"; now one line names the difference, exit 2, no output."""
    import subprocess

    import numpy as np

    from capibara_exp.consensus import store

    for name, rows in (("a", 2), ("b", 3)):
        store.write(tmp_path / name, 2, {("target", "dense", "kernel"):
                                         np.ones((rows, 2), np.float32),
                                         ("state", "step"): np.array(2)})
    before = snapshot(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "capibara_exp.cli.merge", f"runs=[{tmp_path}/a,{tmp_path}/b]",
         f"out={tmp_path}/merged", "method=median", "gate.max_val_loss_ratio=null",
         "gate.max_distance_ratio=null", "gate.require_shared_ancestor=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = error_lines(out.stderr)  # after the merge's first line (it had started)
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "the candidates hold different models" in lines[0]
    assert "target.dense.kernel is (3, 2) float32, others have (2, 2)" in lines[0]
    # refused inside the merge (the candidates are read there): the out dir it began is
    # removed again, and the candidates are as they were
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "."} == \
        {k: v for k, v in before.items() if k != "."}


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A directory this process cannot write: permissions for a user, a read-only tmpfs
    mount for root (who writes through permissions)."""
    import subprocess

    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o555)
        yield target
        target.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"root without mount rights cannot make a read-only dir: {mounted.stderr}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)


@pytest.mark.parametrize("where", ["{ro}", "{ro}/run"])
def test_a_read_only_model_dir_is_one_line_not_a_logging_traceback(
        where: str, read_only_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    args = [f"model_dir={where.format(ro=read_only_dir)}", "debug=fast"]
    _no_job(monkeypatch, cli, args)
    before = snapshot(read_only_dir)
    code, lines = _run(cli.main, args, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"{read_only_dir} cannot be written (read-only or no permission)" in lines[0]
    assert snapshot(read_only_dir) == before
