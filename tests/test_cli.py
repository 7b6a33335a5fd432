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
    probe = ("import sys; from capibara_exp.cli import main as cli; sys.argv = ['capibara-exp', *sys.argv[1:]]\n"
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
    (["model.foo=1"], "Key 'foo' is not in struct"),  # Hydra's own error (status 1)
    (["+model.emb_dimension=64"], "unknown key 'model.emb_dimension'"),
    (["model.emb_dim=???"], "missing mandatory value (???) for: model.emb_dim"),
    (["gin_bindings=['nets.DecoderConfg.emb_dim = 3']"],
     "(from gin_bindings[0], nets.DecoderConfg.emb_dim)"),
    (["engine=t5x"], "T5X is not installed"),
    (['gin_bindings=["nets.DecoderConfig.dropout_rate = 0.0", "nets.DecoderConfig.emb_dim = [1,"]'],
     "gin_bindings[1] (nets.DecoderConfig.emb_dim): EOF in multi-line statement"),
    (["model.mlp_activations='[gelu'"], "model.mlp_activations: expected a list"),
    (["+random_sed=7"], "unknown key 'random_sed' at the root"),
    (["+engine.nme=t5x"], "unknown key 'engine.nme'"),
])
def test_bad_configs_fail_with_a_message_and_status_2(args, message, tmp_path: Path) -> None:
    out = capibara(*args, f"model_dir={tmp_path / 'model'}", cwd=tmp_path)
    assert out.returncode == (1 if "struct" in message else 2), out.stderr[-2000:]
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not list((tmp_path / "model").glob("checkpoint_*"))


@pytest.mark.parametrize("yaml_text, message", [
    ("random_sed: 7\n", "unknown key 'random_sed' at the root"),
    ("engine:\n  nme: t5x\n", "unknown key 'engine.nme'"),
])
def test_unknown_keys_from_an_experiment_file_are_errors(yaml_text: str, message: str,
                                                         tmp_path: Path) -> None:
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    bad = tmp_path / "conf" / "experiment" / "typo.yaml"
    bad.write_text("# @package _global_\n" + yaml_text)
    out = capibara("--config-dir", str(tmp_path / "conf"), "experiment=typo",
                   f"model_dir={tmp_path / 'model'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and str(bad) in out.stderr, out.stderr[-2000:]


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


@pytest.mark.parametrize("same_dir", [True, False])
def test_t5x_operative_config_is_kept_beside_the_rendered_one(same_dir: bool,
                                                               tmp_path: Path) -> None:
    """T5X's summarize_gin_config writes MODEL_DIR/config.gin; with model_dir = the run dir
    that is the rendered file's name: config.gin stays what ran, T5X's goes to
    operative_config.gin."""
    from capibara_exp import experiment

    run_dir, model_dir = tmp_path / "run", tmp_path / ("run" if same_dir else "model")
    run_dir.mkdir()
    model_dir.mkdir(exist_ok=True)
    rendered = "# config.gin rendered by capibara-exp for engine=t5x.\nA = 1\n"
    (run_dir / "config.gin").write_text(rendered)
    (model_dir / "config.gin").write_text("A = 1  # T5X's operative config\n")
    experiment.keep_rendered_config(run_dir / "config.gin", rendered, model_dir, run_dir)
    assert (run_dir / "config.gin").read_text() == rendered
    assert (run_dir / "operative_config.gin").read_text() == "A = 1  # T5X's operative config\n"
