"""The console scripts as a user runs them: fast config paths, one-line errors before any run
dir, T5X's flags, one dir per run that resumes, quiet output, exit codes 0/2/1 for all five."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from capibara_exp.cli import checks, flags
from capibara_exp.cli.common import register_resolvers
from tests.conftest import compose_config
from tests.console_lines import error_lines

HEAVY = ("jax", "tensorflow", "seqio", "flax")
# ...nor what they need only for some configs: gin's parser (a user's gin text binding
# actions), the TPU slice tables (a topology other than cpu)
LAZY = ("gin", "capibara_exp.base.topologies")
# What a quiet run must not print (TensorFlow's and absl's start-up lines, CUDA lookups,
# oneDNN's notice, seqio's advice on uncached tasks, libtpu's probing).
NOISE = re.compile(r"absl::InitializeLog|oneDNN|cuda|cuInit|FunctionDataset|^[IWE]\d{4} |"
                   r"Unable to initialize backend|TPU", re.I | re.M)


def capibara(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capibara_exp.cli", *args], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=600)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"],
                                  ["experiment=dense_small_rope", "--cfg", "job"],
                                  ["model.emb_dm=64"], ["trainer.train_steps=-5"],
                                  ["engine=tpu"]])
def test_config_paths_import_no_jax_tensorflow_or_seqio(args: list[str], tmp_path: Path) -> None:
    """--help, --cfg job and a mistake found when composing (one key) load none of them (nor
    LAZY's), and end without the interpreter's teardown (cli/light_exit.py): their output
    flushed, their exit status kept, no exit handler left unrun but logging's (it runs)."""
    probe = ("import atexit, os, sys; from capibara_exp.cli import main as cli\n"
             "sys.argv = ['capibara-exp', *sys.argv[1:]]\n"
             "def ended(code):\n"
             f"    print('HEAVY', sorted(m for m in {(*HEAVY, *LAZY)!r} if m in sys.modules),\n"
             "          'HANDLERS', atexit._ncallbacks(), flush=True)\n"
             "    real(code)\n"
             "real, os._exit = os._exit, ended\n"
             "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
             "print('NOT ENDED')")
    out = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    mistake = not any(a.startswith("-") for a in args)
    assert out.returncode == (2 if mistake else 0), out.stderr
    assert "HEAVY [] HANDLERS 1" in out.stdout, out.stdout[-500:]
    assert "NOT ENDED" not in out.stdout
    if mistake:  # refused, in one line
        assert error_lines(out.stderr)[0].startswith("capibara-exp: configuration error: ")
        assert len(lines(out.stderr)) == 1, out.stderr


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["model.emb_dm=64"]])
def test_a_caller_that_goes_on_is_never_ended(args, tmp_path, monkeypatch, capsys) -> None:
    """main(argv) called in a process that goes on (a test, a fuzzer) returns or raises
    SystemExit even where sys.argv reads like the console script's: only the console
    script's own call (main() reading argv) ends without the teardown."""
    from capibara_exp.cli import main as cli

    def ended(code: int) -> None:
        raise AssertionError(f"os._exit({code}) in a process that goes on")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["capibara-exp", *args])
    monkeypatch.setattr(os, "_exit", ended)
    try:
        cli.main(args)
    except SystemExit as stop:
        assert stop.code in (None, 0, 2)
    capsys.readouterr()


def test_shell_completion_installs_through_hydra(tmp_path: Path) -> None:
    """-sc install=bash reaches Hydra's completion (not composed as a config key)."""
    out = capibara("-sc", "install=bash", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "complete" in out.stdout and "hydra_bash_completion" in out.stdout


def test_help_lists_groups_sweeps_the_sweeper_and_the_other_scripts(tmp_path: Path) -> None:
    out = capibara("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for group in ("model", "data", "optimizer", "schedule", "trainer", "partitioning",
                  "checkpoint", "engine", "experiment", "debug"):
        assert f"{group}:" in out.stdout
    assert "sweeps: lr_wd, moe_routing, pass_at_k, schedule" in out.stdout
    assert "hydra/sweeper=capibara_optuna" in out.stdout and "n_trials" in out.stdout
    for script in ("capibara-exp-data", "capibara-exp-merge", "capibara-exp-tune-mesh",
                   "capibara-exp-plot"):
        assert script in out.stdout
    assert "--gin_file" in out.stdout


@pytest.mark.parametrize("args", [["--help"], ["experiment=dense_small_rope", "--help"],
                                  ["hydra.help.template=$CONFIG", "--help"],  # (rendered lazily)
                                  ["--cfg", "job"], ["experiment=moe_e2b_tiny", "--cfg=job"],
                                  ["--cfg", "job", "--gin.nets.DecoderConfig.dropout_rate=0.1"]])
def test_help_and_cfg_job_are_the_text_hydra_renders(args: list[str], tmp_path: Path) -> None:
    """capibara-exp renders --help and --cfg job itself (Hydra lists each group through a
    new repository, and composes again: seconds); the text is Hydra's own for the line."""
    hydra_help = ("import sys\n"
                  "from capibara_exp.cli.common import checked_argv, register_sweeper\n"
                  "from capibara_exp.cli import main\n"
                  "_, _, argv = checked_argv('capibara-exp', 'config', sys.argv[1:])\n"
                  "sys.argv = ['capibara-exp', *argv]\nregister_sweeper()\nmain._app()\n")
    theirs = subprocess.run([sys.executable, "-c", hydra_help, *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    ours = capibara(*args, cwd=tmp_path)
    assert theirs.returncode == ours.returncode == 0, theirs.stderr + ours.stderr
    assert ours.stdout == theirs.stdout


def test_merge_help_shows_its_keys_and_methods(tmp_path: Path) -> None:
    from capibara_exp.consensus.merge import METHODS

    out = subprocess.run([sys.executable, "-c", "from capibara_exp.cli.merge import main; main()",
                          "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(m in out.stdout for m in (*METHODS, "fedavg"))
    for key in ("runs: ???", "out: ???", "num_byzantine: 0", "gate:", "fedavg:"):
        assert key in out.stdout


BAD = [
    # values: each one line naming the key, who set it, the value and what is allowed
    (["trainer.train_steps=-5"], "trainer.train_steps=-5 (set by the command line): expected "
                                 "an integer >= 1"),
    (["model.emb_dim=abc"], "model.emb_dim=abc (set by the command line): expected an integer"),
    (["schedule.base_learning_rate=fast"], "schedule.base_learning_rate=fast (set by the command "
                                           "line): expected a number > 0 and <= 1"),
    # interpolations: checked resolved (the others as written: config_check._interpolated)
    (["trainer.train_steps=${random_seed}"], "trainer.train_steps=0 (set by the command line): "
                                             "expected an integer >= 1"),
    (["model.emb_dim=${oc.env:CAPIBARA_NO_SUCH_VAR}"], "model.emb_dim (set by the command line): "
                                                       "KeyError raised while resolving"),
    # key typos and options: a did-you-mean
    (["model.emb_dm=64"], "unknown key 'model.emb_dm' (set by the command line): the config has "
                          "no such key; did you mean 'model.emb_dim'?"),
    (["+model.emb_dimension=64"], "unknown key 'model.emb_dimension'"),
    (["+random_sed=7"], "unknown key 'random_sed' at the root"),
    (["+engine.nme=t5x"], "unknown key 'engine.nme'"),
    (["model=dense_tny"], "model=dense_tny: no such option in model/ (choose from dense_small, "
                          "dense_tiny, gemma2_9b, gemma2_tiny, gemma3_4b, gemma3_tiny, llama2_70b, "
                          "llama2_7b, llama3_70b, llama3_8b, llama3_tiny, maxtext_v5e, mistral_7b, "
                          "mistral_tiny, mixtral_8x7b, "
                          "mixtral_tiny, moe_base, moe_tiny, qwen2_5_7b, qwen2_5_tiny, qwen3_8b, "
                          "qwen3_moe_30b_a3b, qwen3_moe_tiny, qwen3_tiny); did you mean "
                          "'dense_tiny'?"),
    (["model.emb_dim=???"], "missing mandatory value (???) for: model.emb_dim"),
    (["model.mlp_activations='[gelu'"], "model.mlp_activations=[gelu (set by the command "
                                        "line): expected a list"),
    (["trainer.eval_period=30"], "trainer.eval_period=30 and checkpoint.checkpoint_period=100"),
    # gin: T5X's flags and gin_bindings, checked against the engine's configurables
    (["--gin.MODEL_DIR"], "--gin.MODEL_DIR: T5X's --gin.NAME=VALUE binds NAME = VALUE"),
    (["--gin_file=missing.gin"], "gin_files[0]: gin file 'missing.gin' not found"),
    (["gin_bindings=['nets.DecoderConfg.emb_dim = 3']"],
     "(from gin_bindings[0], nets.DecoderConfg.emb_dim)"),
    (['gin_bindings=["nets.DecoderConfig.dropout_rate = 0.0", "nets.DecoderConfig.emb_dim = [1,"]'],
     "gin_bindings[1] (nets.DecoderConfig.emb_dim): EOF in multi-line statement"),
]
if importlib.util.find_spec("t5x") is None:
    BAD.append((["engine=t5x"], "T5X is not installed"))


@pytest.mark.parametrize("args, message", BAD)
def test_bad_command_lines_are_one_line_status_2_and_no_run_dir(args, message,
                                                                tmp_path: Path) -> None:
    out = capibara(*args, f"model_dir={tmp_path / 'model'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(error_lines(out.stderr)) == 1 and message in error_lines(out.stderr)[0], out.stderr
    assert not (tmp_path / "model").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("yaml_text, message", [
    ("random_sed: 7\n", "unknown key 'random_sed' at the root"),
    ("engine:\n  nme: t5x\n", "unknown key 'engine.nme'"),
    ("trainer:\n  train_steps: 0\n", "trainer.train_steps=0 (set by {file}): expected an integer"),
])
def test_keys_and_values_from_an_experiment_file_name_that_file(yaml_text: str, message: str,
                                                                 tmp_path: Path) -> None:
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    bad = tmp_path / "conf" / "experiment" / "typo.yaml"
    bad.write_text("# @package _global_\n" + yaml_text)
    out = capibara("--config-dir", str(tmp_path / "conf"), "experiment=typo",
                   f"model_dir={tmp_path / 'model'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message.format(file=bad) in out.stderr and str(bad) in out.stderr, out.stderr[-2000:]


def test_malformed_yaml_names_file_and_line_only_where_it_is_used(tmp_path: Path) -> None:
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "broken.yaml").write_text("emb_dim: [64\n")
    conf = ["--config-dir", str(tmp_path / "conf")]
    out = capibara(*conf, "model=broken", cwd=tmp_path)
    assert out.returncode == 2
    assert "broken.yaml:2:1: malformed YAML" in out.stderr and len(lines(out.stderr)) == 1
    for unaffected in (["--cfg", "job"], ["--help"]):  # commands that do not read the file
        out = capibara(*conf, *unaffected, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]


def test_t5x_flags_append_to_the_gin_keys_and_render_after_the_config(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """T5X's --gin_file, --gin.X=V and --gin_bindings: the rendered gin, then the files, then
    the bindings, as T5X applies them; a file's import lines for the engine's names are left
    to the engine header, so a gin file written for T5X binds the local engine's too."""
    from capibara_exp.base.paths import GIN_DIR
    from capibara_exp.composing import gin_bridge

    monkeypatch.chdir(tmp_path)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "more.gin").write_text("nets.DecoderConfig.dropout_rate = 0.25\n")
    (tmp_path / "extra.gin").write_text(
        "from __gin__ import dynamic_registration\nfrom t5x import utils\n"
        "include 'more.gin'\nutils.SaveCheckpointConfig.keep = 2\n")
    register_resolvers()
    line = flags.parse(["--gin_file=extra.gin", "--gin_search_paths=inc", "--gin.TRAIN_STEPS=7",
                        "--gin_bindings", "nets.DecoderConfig.logits_via_embedding = True",
                        "debug=fast",
                        "gin_bindings=['EVAL_STEPS = 1']", "model_dir=/tmp/x"])
    comp, overrides = checks.compose_checked(line, "config")
    cfg = checks.without_hydra(comp.cfg)
    assert list(cfg.gin_bindings) == ["EVAL_STEPS = 1", "TRAIN_STEPS = 7",
                                      "nets.DecoderConfig.logits_via_embedding = True"]
    assert list(cfg.gin_files) == [str(tmp_path / "extra.gin")]
    assert any(o.startswith("gin_bindings=") for o in overrides)  # what Hydra records
    text = gin_bridge.render(cfg, "local", GIN_DIR)
    values, files, bindings = (text.index(mark) for mark in (
        "# ===== values from conf/", "# ===== gin_files[0]", "# ===== gin_bindings"))
    assert values < files < bindings
    assert "# (the engine header provides: from t5x import utils)" in text
    assert "nets.DecoderConfig.dropout_rate = 0.25" in text  # the include, found on the path
    from capibara_exp.runtime import gin_utils

    gin_utils.parse(tmp_path / "config.gin", text)  # parses under the local header
    import gin

    assert gin.query_parameter("%TRAIN_STEPS") == 7  # the flag wins over conf's value
    assert gin.query_parameter("utils.SaveCheckpointConfig.keep") == 2


def test_model_dir_is_the_run_dir_and_the_default_is_time_stamped() -> None:
    cfg = compose_config(["model_dir=runs/a"])
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from capibara_exp.base.paths import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        named = compose("config", overrides=["model_dir=runs/a"], return_hydra_config=True)
        default = compose("config", overrides=[], return_hydra_config=True)
    assert OmegaConf.select(named, "hydra.run.dir") == "runs/a" == cfg.model_dir
    assert re.fullmatch(r"outputs/dense_tiny_lm/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d",
                        OmegaConf.select(default, "hydra.run.dir"))
    assert default.model_dir is None


def test_t5x_runs_with_the_interpreter_running_capibara_exp(tmp_path: Path) -> None:
    from capibara_exp import experiment

    cfg = compose_config(["engine=t5x"])
    assert cfg.engine.python is None
    command = experiment.t5x_command(cfg, tmp_path / "config.gin")
    assert command[0] == sys.executable and command[1:3] == ["-m", "capibara_exp.launch.t5x_main"]
    assert command[3] == f"--gin_file={tmp_path / 'config.gin'}"


@pytest.mark.entry
@pytest.mark.slow
def test_a_run_is_one_quiet_dir_that_resumes_there(tmp_path: Path, data_dir: Path) -> None:
    """model_dir=X: X holds config.gin, the Hydra config and log, checkpoints, metrics and TB
    events; the console shows no library noise; re-running resumes in X and prints X."""
    run = tmp_path / "run"
    (tmp_path / "extra.gin").write_text("train_script.train.stats_period = 1\n")
    args = ["debug=fast", "model.emb_dim=32", "model.mlp_dim=64", "data.batch_size=4",
            f"data_dir={data_dir}", f"model_dir={run}", "--gin_file=extra.gin",
            "--gin.nets.DecoderConfig.dropout_rate=0.125"]
    out = capibara(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not NOISE.search(out.stderr), out.stderr
    assert f"capibara-exp: run dir {run}" in out.stderr
    assert lines(out.stderr)[-1] == f"capibara-exp: done; run dir {run}"
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "capibara-exp.log", "config.gin",
                 "operative_config.gin", "metrics.jsonl", "checkpoint_4/state",
                 "checkpoint_4/capibara_manifest.json"):
        assert (run / name).exists(), name
    assert list((run / "train").glob("events.*")) and list((run / "train_eval").glob("events.*"))
    assert not (tmp_path / "outputs").exists()
    assert lines(out.stderr)[0] == "capibara-exp: starting (engine=local) ..."
    # every console line says whose it is, the step lines too (stats_period=1: one a step)
    assert "capibara-exp: step 3/4  loss " in out.stderr
    assert all(ln.startswith("capibara-exp: ") for ln in lines(out.stderr + out.stdout)), \
        out.stderr
    # The run log holds the Python log: the libraries' INFO records (orbax's, through absl),
    # which the quiet console leaves out, and capibara-exp's own lines.
    log = (run / "capibara-exp.log").read_text()
    orbax = [ln for ln in log.splitlines() if "[absl][INFO]" in ln and "orbax" in ln.lower()]
    assert orbax and "[absl]" not in out.stderr and "orbax" not in out.stderr.lower(), log[:2000]
    assert f"capibara-exp: run dir {run}" in log and "compiled and ran step 1" in log
    gin_text = (run / "config.gin").read_text()
    assert "# ===== gin_files[0]" in gin_text and "dropout_rate = 0.125" in gin_text
    assert "dropout_rate = 0.125" in (run / "operative_config.gin").read_text()
    out = capibara(*args, "trainer.train_steps=6", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"restored {run}/checkpoint_4" in out.stderr and f"run dir {run}" in out.stderr
    steps = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6 and not (tmp_path / "outputs").exists()


SCRIPTS = {
    # script: (success, user error, the library function a failure is injected into)
    "main": (["--cfg", "job"], ["trainer.train_steps=0"], "capibara_exp.experiment:run"),
    "data": (["--cfg", "job"], ["splits.validation_percent=200"],
             "capibara_exp.data.e2b.build:ensure_built"),
    "merge": (["--help"], ["runs=[a]"], "capibara_exp.consensus.merge_command:run_merge"),
    "tune_mesh": (["--cfg", "job"], ["tune_mesh.n_trials=0"], "capibara_exp.tuning.plan:run"),
    "plot": (["RUN"], ["EMPTY"], "capibara_exp.cli.run_curves:render"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_exits_0_2_or_1(script: str, tmp_path: Path) -> None:
    """0 on success, 2 for a user error (one line), 1 for an internal failure (one line
    naming it; the traceback only with CAPIBARA_VERBOSE=1)."""
    ok, bad, target = SCRIPTS[script]
    (tmp_path / "RUN").mkdir()
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "RUN" / "metrics.jsonl").write_text(
        '{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "split": "train", "loss": 1.5}\n')
    module, name = target.split(":")
    program = (f"import sys; from capibara_exp.cli.{script} import main\n"
               "if sys.argv[1] == 'BOOM':\n"
               f"    import {module} as m\n"
               "    def boom(*a, **k): raise RuntimeError('injected failure')\n"
               f"    m.{name} = boom\n"
               "    sys.argv.pop(1)\n"
               f"sys.argv[0] = 'capibara-exp-{script}'\nmain()\n")

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", program, *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    assert call(*ok).returncode == 0
    out = call(*bad)
    assert out.returncode == 2 and len(lines(out.stderr)) == 1, out.stderr[-2000:]
    boom_args = {"main": ["debug=fast", f"model_dir={tmp_path / 'm'}"], "data": [],
                 "merge": ["runs=[a]", f"out={tmp_path / 'merged'}"], "tune_mesh": [],
                 "plot": ["RUN", "--overwrite"]}[script]
    (tmp_path / "a").mkdir()  # merge's run: the paths pass, the injected failure is next
    out = call("BOOM", *boom_args)
    assert out.returncode == 1 and "injected failure" in out.stderr, out.stderr[-2000:]
    # one line of its own after the run's progress lines (a run that started says so first)
    assert len(error_lines(out.stderr)) == 1 and "Traceback" not in out.stderr, \
        out.stderr[-2000:]


def test_experiment_run_needs_no_hydra_state(tmp_path: Path, capsys) -> None:
    """experiment.run takes the run dir and the group choices as arguments (here a TPU VM
    launch, written and printed as a dry run), with no Hydra job around it."""
    from hydra.core.hydra_config import HydraConfig

    from capibara_exp import experiment

    assert not HydraConfig.initialized()
    cfg = compose_config(["model_dir=null", "experiment=moe_e2b_base", "engine=tpu_vm",
                          "engine.tpu_name=slice",
                          "engine.zone=us-west4-a", "engine.workdir=/mnt/shared"])
    experiment.run(cfg, tmp_path / "run", {"experiment": "moe_e2b_base", "engine": "tpu_vm"})
    assert (tmp_path / "run" / "config.gin").is_file()
    assert (tmp_path / "run" / "launch_tpu_vm.sh").is_file()
    assert "dry run" in capsys.readouterr().err
