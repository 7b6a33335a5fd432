"""The console script as a user runs it: fast config paths, loud errors, one real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("jax", "tensorflow", "seqio", "flax")


def capibara(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capibara_exp.cli", *args], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=600)


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["experiment=dense_small_rope", "--cfg", "job"]])
def test_config_paths_import_no_jax_tensorflow_or_seqio(args: list[str], tmp_path: Path) -> None:
    probe = ("import sys; from capibara_exp import cli; sys.argv = ['capibara-exp', *sys.argv[1:]]\n"
             "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
             f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_help_lists_the_config_groups(tmp_path: Path) -> None:
    out = capibara("--help", cwd=tmp_path)
    for group in ("model", "data", "optimizer", "schedule", "trainer", "partitioning",
                  "checkpoint", "engine", "experiment", "debug"):
        assert f"{group}:" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["model.foo=1"], "Key 'foo' is not in struct"),
    (["+model.emb_dimension=64"], "unknown key 'model.emb_dimension'"),
    (["model.emb_dim=???"], "missing mandatory value (???) for: model.emb_dim"),
    (["gin_bindings=['nets.DecoderConfg.emb_dim = 3']"], "(from gin_bindings)"),
    (["engine=t5x"], "T5X is not installed"),
])
def test_bad_configs_fail_with_a_message_and_status_2(args, message, tmp_path: Path) -> None:
    out = capibara(*args, f"model_dir={tmp_path / 'model'}", cwd=tmp_path)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    assert not list((tmp_path / "model").glob("checkpoint_*"))


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "broken.yaml").write_text("emb_dim: [64\n")
    out = capibara("--config-dir", str(tmp_path / "conf"), "model=broken", cwd=tmp_path)
    assert out.returncode == 2
    assert "broken.yaml:2:1: malformed YAML" in out.stderr


@pytest.mark.entry
def test_debug_run_from_the_command_line(tmp_path: Path, data_dir: Path) -> None:
    out = capibara("debug=fast", "model.emb_dim=32", "model.mlp_dim=64", "data.batch_size=4",
                   f"data_dir={data_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dirs = list((tmp_path / "outputs" / "dense_tiny_lm").iterdir())
    assert len(run_dirs) == 1 and f"run dir {run_dirs[0]}" in out.stderr
    run = run_dirs[0]
    for name in (".hydra/config.yaml", "config.gin", "operative_config.gin", "metrics.jsonl",
                 "checkpoint_4/state"):
        assert (run / name).exists(), name
    assert "step 4/4" in out.stderr and "ETA" in out.stderr
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4
