"""OS faults for the real console scripts (tests/os_faults.py): a tiny training resume, a
data build, a merge, a plot and a generation, each in its own process under a small file
size limit (RLIMIT_FSIZE: EFBIG, the full disk's stand-in), few descriptors
(RLIMIT_NOFILE: EMFILE) and on a 2 MB tmpfs (a disk that fills: ENOSPC). For every case:
exit 0, 1, 2 or 75; the console holds the script's own lines and a failure is the last,
the only one; the inputs are as they were; a run's last good checkpoint is intact.
`python -m tests.os_faults` runs every script under every limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import os_faults

SCRIPTS = sorted(os_faults.MODULE)
# capibara-exp under fsize=100k (a checkpoint's data file over the limit): its own test below
CASES = [(script, limit) for script in SCRIPTS for limit in ("fsize=4k", "fsize=100k",
                                                               "nofile=24")
         if (script, limit) != ("capibara-exp", "fsize=100k")]
CASES += [("capibara-exp", "nofile=12"), ("capibara-exp-merge", "nofile=12"),
          ("capibara-exp-generate", "fsize=512")]  # its outputs are under 4 KB


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, Path, Path]:
    return os_faults.prepare(tmp_path_factory.mktemp("faults"), data_dir)


def _check(script: str, out, found: list[str]) -> None:
    assert not found, f"{script}: exit {out.returncode}: {found}\n{out.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("script, limit", CASES, ids=[f"{s} {n}" for s, n in CASES])
def test_a_script_under_a_resource_limit_fails_in_one_line_and_keeps_its_inputs(
        script: str, limit: str, inputs, tmp_path: Path) -> None:
    out, found = os_faults.one_case(script, [os_faults.LIMITS[limit]], *inputs,
                                    tmp_path / "work")
    _check(script, out, found)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["capibara-exp", "capibara-exp-data",
                                    "capibara-exp-merge"])
def test_a_script_on_a_disk_that_fills_fails_in_one_line(script: str, inputs,
                                                         tmp_path: Path) -> None:
    with os_faults.tiny_disk(tmp_path / "work", "2m" if script == "capibara-exp" else
                             "64k") as why_not:
        if why_not:  # docs/errors.md: then RLIMIT_FSIZE above is the full disk's stand-in
            pytest.skip(f"no tmpfs here: {why_not}")
        out, found = os_faults.one_case(script, [], *inputs, tmp_path / "work")
    _check(script, out, found)
    if script == "capibara-exp":  # the run's copy fits; its next checkpoint does not
        assert out.returncode == 1 and "(ENOSPC)" in out.stderr.splitlines()[-1], out.stderr


def test_the_fault_cases_fail_where_they_should() -> None:
    """The property's check is not vacuous: a library's log line beside the failure, two
    failure lines, a traceback and a signal's death are each found."""
    import subprocess

    def done(code: int, err: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], code, "", err)

    ok = "capibara-exp: starting ...\nstep 2/4  loss 1\ncapibara-exp: x: No space (ENOSPC)\n"
    assert os_faults.problems("capibara-exp", done(1, ok)) == []
    in_path = "capibara-exp: run dir /tmp/test_orbax_errors0/run\n" + ok  # a word of a path
    assert os_faults.problems("capibara-exp", done(1, in_path)) == []
    assert os_faults.problems("capibara-exp", done(1, "[absl][ERROR] - save failed\n" + ok))
    assert os_faults.problems("capibara-exp", done(1, ok + "capibara-exp: internal error: x\n"))
    assert os_faults.problems("capibara-exp", done(1, "Traceback (most recent call last):\n"))
    assert os_faults.problems("capibara-exp", done(-25, ""))
    assert os_faults.problems("capibara-exp", done(0, ok))  # exit 0 with a failure line


@pytest.mark.slow
def test_orbax_errors_of_a_save_the_disk_fails_go_to_the_run_log_only(inputs,
                                                                      tmp_path: Path) -> None:
    """A file size limit that the next checkpoint's data file exceeds: orbax's writer
    threads log ERROR lines; the console shows the one line (EFBIG, the checkpoint's
    path, what was kept), the run log holds orbax's lines."""
    out, found = os_faults.one_case("capibara-exp", [os_faults.LIMITS["fsize=100k"]],
                                    *inputs, tmp_path / "work")
    _check("capibara-exp", out, found)
    last = out.stderr.splitlines()[-1]
    assert out.returncode == 1 and "File too large (writing a checkpoint) (EFBIG) (this " \
        f"process may have {100 << 10} bytes a file: ulimit -f)" in last, last
    assert "[absl][ERROR]" not in out.stderr
    run_log = (tmp_path / "work" / "resumed" / "capibara-exp.log").read_text()
    assert "[absl][ERROR]" in run_log and "File too large" in run_log


def test_library_records_reach_the_run_log_not_the_console(tmp_path: Path) -> None:
    import io
    import logging

    from capibara_exp.cli import shell

    console, late, root = io.StringIO(), io.StringIO(), logging.getLogger()
    handlers = [logging.StreamHandler(console), logging.FileHandler(tmp_path / "run.log")]
    saved = root.handlers[:], root.level
    root.handlers[:] = handlers
    root.setLevel(logging.INFO)
    try:
        shell.libraries_off_console()
        shell.libraries_off_console()
        forwarders = list(logging.getLogger("absl").handlers)
        root.addHandler(logging.StreamHandler(late))  # one a library's basicConfig adds
        logging.getLogger("absl").error("save failed: Error writing local file")
        logging.getLogger("orbax.checkpoint").error("commit failed")
        logging.getLogger("py.warnings").warning("UserWarning: Error writing persistent "
                                                 "compilation cache entry")
        logging.getLogger("capibara_exp.runtime").warning("own warning")
    finally:
        handlers[1].close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name in shell.LIBRARIES:  # as it was for the other tests of this process
            logger = logging.getLogger(name)
            logger.handlers[:] = [h for h in logger.handlers
                                  if not isinstance(h, shell._RunLogOnly)]
            logger.propagate = True
    assert console.getvalue() == late.getvalue() == "own warning\n"
    assert sum(isinstance(h, shell._RunLogOnly) for h in forwarders) == 1  # idempotent
    logged = (tmp_path / "run.log").read_text()
    assert "save failed" in logged and "commit failed" in logged and "own warning" in logged
    assert "compilation cache entry" in logged


def test_tensorstore_os_errors_are_the_machines_not_the_users() -> None:
    """tensorstore's reports (as orbax raises them) of a full disk, the file size limit and
    too many open files: the OS failure with its errno and path; a missing file is not."""
    import errno

    from capibara_exp.base.errors import environment_failure
    from capibara_exp.cli import shell

    size = ValueError('OUT_OF_RANGE: Error writing "k/0" in OCDBT database at local file '
                      '"/r/checkpoint_6.orbax-checkpoint-tmp/": Failed writing: "/r/x/d/8": '
                      "File too large [os_error_code='27']")
    full = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/r/_METADATA": x')
    files = ValueError('UNKNOWN: Error reading local file "/r/c/manifest.ocdbt": Too many '
                       "open files [os_error_code='24']")
    missing = ValueError("NOT_FOUND: Error reading \"/r/x\" [os_error_code='2']")
    found = {k: shell._tensorstore_os_error(e) for k, e in
             (("size", size), ("full", full), ("files", files), ("missing", missing))}
    assert (found["size"].errno, found["size"].filename) == (
        errno.EFBIG, "/r/checkpoint_6.orbax-checkpoint-tmp/")
    assert (found["full"].errno, found["full"].filename) == (errno.ENOSPC, "/r/_METADATA")
    assert (found["files"].errno, found["files"].filename) == (errno.EMFILE,
                                                               "/r/c/manifest.ocdbt")
    assert found["missing"] is None and not shell.disk_failure(missing)
    assert environment_failure(files) and environment_failure(OSError(errno.EMFILE, "x"))
    assert not environment_failure(missing) and not environment_failure(OSError(2, "x"))


def test_a_resume_that_runs_out_of_descriptors_sets_no_checkpoint_aside(
        tmp_path: Path, monkeypatch) -> None:
    """Reading a checkpoint's metadata fails for want of descriptors: the error goes up (the
    shell's one line), the checkpoint is not judged damaged (moved to corrupt/)."""
    import errno

    from capibara_exp.runtime import resume

    def no_descriptors(path, template):
        raise OSError(errno.EMFILE, "Too many open files", str(path))

    monkeypatch.setattr(resume, "_tree_mismatch", no_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        resume._check_tree(tmp_path, {})
    monkeypatch.setattr(resume, "_tree_mismatch",
                        lambda p, t: (_ for _ in ()).throw(ValueError("bad zarr metadata")))
    assert resume._check_tree(tmp_path, {}).startswith("unreadable metadata (ValueError")
