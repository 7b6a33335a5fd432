"""Hydra's own flags on every console script that is a Hydra app: `--cfg job|hydra|all`
(with `--resolve`, `--package`), `--info`, `--help` and `--hydra-help` print what Hydra's app
for that script's config prints, run no job, write nothing, and load no JAX, TensorFlow or
SeqIO. The reference is a bare `hydra.main` app over the same config and argv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("jax", "tensorflow", "seqio", "flax")

# script module: (its config, the values it must be given, what its command line adds)
HYDRA_SCRIPTS = {
    "main": ("config", [], []),
    "data": ("data_build", [], []),
    "merge": ("merge", ["runs=[a]", "out=merged"], []),
    "tune_mesh": ("config", [], ["+tune_mesh=default"]),
    "meta": ("meta", ["out=meta_out"], []),
}
FLAGS = [["--info"], ["--cfg", "job"], ["--cfg", "hydra", "--resolve", "--package", "hydra.job"],
         ["--cfg", "all"], ["--info", "defaults"], ["--help"], ["--hydra-help"]]

OURS = ("import os, sys\n"
        "from capibara_exp.cli import {script} as cli\n"
        "sys.argv = ['capibara-exp-{script}', *sys.argv[1:]]\n"
        "def heavy():\n"
        "    print('HEAVY', sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\n"
        "real_exit = os._exit  # (--help and --cfg job end there: cli/light_exit.py)\n"
        "os._exit = lambda code: (heavy(), sys.stderr.flush(), real_exit(code))\n"
        "try:\n    cli.main()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "sys.stdout.flush()\n"
        "heavy()\n"
        "sys.exit(code)\n")
HYDRA = ("import sys, hydra\n"
         "from capibara_exp.cli.common import register_sweeper\n"
         "from capibara_exp.base.paths import CONF_DIR\n"
         "from capibara_exp.composing.resolvers import register_resolvers\n"
         "register_resolvers()\n"
         "if '{script}' == 'main':  # (its sweeper; --info lists the plugins)\n"
         "    register_sweeper()\n"
         "sys.argv = ['capibara-exp-{script}', *sys.argv[1:]]\n"
         "@hydra.main(config_path=str(CONF_DIR), config_name='{config}', version_base='1.3')\n"
         "def task(cfg):\n    print('THE JOB RAN')\n"
         "task()\n")


def run(program: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPIBARA")}
    return subprocess.run([sys.executable, "-c", program, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: " ".join(f))
@pytest.mark.parametrize("script", sorted(HYDRA_SCRIPTS))
def test_hydra_flags_answer_as_hydra_does(script: str, flags: list[str],
                                          tmp_path: Path) -> None:
    config, values, added = HYDRA_SCRIPTS[script]
    # --hydra-help composes Hydra's config alone: the app's keys are not overrides there
    values = [] if flags == ["--hydra-help"] else values
    args = [*flags, *values]
    (tmp_path / "a").mkdir()
    # Hydra's argv with the flags last (a bare --info would take the next override as its
    # value: the scripts hand Hydra their overrides first)
    theirs = run(HYDRA.format(script=script, config=config), [*values, *added, *flags], tmp_path)
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert "THE JOB RAN" not in theirs.stdout  # (a flag Hydra answers alone)
    ours = run(OURS.format(script=script, heavy=HEAVY), args, tmp_path)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout
    assert "HEAVY []" in ours.stderr, ours.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no run dir, no out, no .hydra


@pytest.mark.parametrize("script", ["merge", "meta"])
def test_cfg_job_shows_the_values_to_give_as_hydra_does(script: str, tmp_path: Path) -> None:
    """--cfg job without the mandatory values (`???`) prints them, as Hydra does; the run
    itself still refuses the line."""
    config, _, _ = HYDRA_SCRIPTS[script]
    theirs = run(HYDRA.format(script=script, config=config), ["--cfg", "job"], tmp_path)
    ours = run(OURS.format(script=script, heavy=HEAVY), ["--cfg", "job"], tmp_path)
    assert theirs.returncode == ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout and "???" in ours.stdout
    refused = run(OURS.format(script=script, heavy=HEAVY), [], tmp_path)
    assert refused.returncode == 2 and "missing mandatory value (???)" in refused.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", sorted(HYDRA_SCRIPTS))
def test_a_mistake_found_composing_is_one_line_without_heavy_imports(script: str,
                                                                      tmp_path: Path) -> None:
    _, values, _ = HYDRA_SCRIPTS[script]
    out = run(OURS.format(script=script, heavy=HEAVY), [*values, "no_such_key=1"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    first, heavy = out.stderr.splitlines()
    prog = {"main": "capibara-exp"}.get(script, f"capibara-exp-{script.replace('_', '-')}")
    assert first.startswith(f"{prog}: configuration error: unknown key 'no_such_key'"), first
    assert heavy == "HEAVY []" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--help", "--info", "--hydra-help"])
@pytest.mark.parametrize("script", sorted(HYDRA_SCRIPTS))
def test_a_mistake_beside_a_flag_that_informs_is_one_line(script: str, flag: str,
                                                         tmp_path: Path) -> None:
    """Hydra's app refuses an override it cannot apply with an exception midway through
    what it prints; the scripts compose the line first: one line, exit 2, nothing printed
    before it and nothing written."""
    out = run(OURS.format(script=script, heavy=HEAVY), ["modl=x", flag], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stdout == ""
    first, heavy = out.stderr.splitlines()
    assert ": configuration error: unknown key 'modl'" in first, first
    assert heavy == "HEAVY []" and list(tmp_path.iterdir()) == []
