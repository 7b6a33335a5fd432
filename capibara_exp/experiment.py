"""One run: composed config -> config.gin in the run dir -> checked -> the engine trains it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from omegaconf import DictConfig, open_dict

from capibara_exp.base import environment, phases, topologies
from capibara_exp.base.errors import ConfigError, RunError
from capibara_exp.base.paths import CONF_DIR, GIN_DIR
from capibara_exp.composing import gin_actions, gin_bridge
from capibara_exp.data import corpus
from capibara_exp.data.e2b import built
from capibara_exp.launch import distributed, peers, tpu_vm

CONFIG_GIN = "config.gin"
DATA_DIR_ENV = "CAPIBARA_DATA_DIR"
ROUTING_TASKS = "capibara_exp.data.routing_tasks"
# The task modules that read the built E2B data (data/e2b/built.py).
E2B_TASK_MODULES = (ROUTING_TASKS, "capibara_exp.data.routing_difficulty",
                    "capibara_exp.generation.codegen_task")


def config_sources(choices: dict[str, str | None]) -> dict[str, str]:
    """Group -> the conf/ file that set it, for error messages."""
    sources = {"root": str(CONF_DIR / "config.yaml")}
    for group, choice in choices.items():
        if choice and not group.startswith("hydra"):
            sources[group] = str(CONF_DIR / group / f"{choice}.yaml")
    if choices.get("experiment"):
        for group in gin_bridge.GIN_GROUPS:
            sources[group] = (f"{sources.get(group, CONF_DIR / group)} or "
                              f"{CONF_DIR / 'experiment' / choices['experiment']}.yaml")
    return sources


def title(choices: dict[str, str | None]) -> str:
    picked = " ".join(f"{g}={c}" for g, c in sorted(choices.items())
                      if c and not g.startswith("hydra"))
    return f"From: capibara-exp {picked}"


def write_gin(cfg: DictConfig, run_dir: Path, choices: dict[str, str | None],
              before_check: Callable[[], object] | None = None) -> Path:
    """Render config.gin for the configured engine, write it, and check that it parses.

    `before_check` runs between the two: after the bridge's own errors, before the check
    imports the runtime (JAX)."""
    engine = gin_engine(cfg)
    sources = config_sources(choices)
    text = gin_bridge.render(cfg, engine, GIN_DIR, sources, title(choices))
    path = run_dir / CONFIG_GIN
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for note in gin_actions.notes(text):  # a user's actions binding joined, not replacing
        say(note)
    if before_check:
        before_check()
    # The body is the same for every engine: check it against the local engine's
    # configurables (same names and parameters), before anything compiles.
    local_text = text if engine == "local" else gin_bridge.render(cfg, "local", GIN_DIR, sources,
                                                                  title(choices))
    from capibara_exp.runtime import gin_utils

    gin_utils.parse(path, local_text)
    return path


def gin_engine(cfg: DictConfig) -> str:
    """Whose import header config.gin gets: the engine's, or for engine=tpu_vm the runtime
    its workers run (t5x or local)."""
    return cfg.engine.runtime if cfg.engine.name == "tpu_vm" else cfg.engine.name


def data_builds(cfg: DictConfig) -> list[str]:
    """The built data sets a run reads, by their `capibara-exp-data datasets` names: the
    text corpus (data/corpus.py) when a task it reads (its data, a curriculum stage, the
    inference eval) is the corpus' task, the E2B data (data/e2b/built.py) when such a task's
    module is one that reads them (the code-generation eval not with its own logs)."""
    stages = (cfg.get("curriculum") or {}).get("curriculum_stages") or []
    infer_eval = cfg.get("infer_eval") or {}
    names = {cfg.data.get("mixture_or_task_name"), infer_eval.get("infer_eval_task"),
             *(s.get("mixture_or_task_name") for s in stages)}
    modules = {cfg.data.get("mixture_or_task_module"), *(s.get("module") for s in stages)}
    if not os.environ.get(built.CODEGEN_LOGS_ENV):
        modules.add(infer_eval.get("infer_eval_module"))
    needs = [corpus.CORPUS_NAME] if any(corpus.reads_corpus(n) for n in names) else []
    return needs + ([built.DATASET] if modules & set(E2B_TASK_MODULES) else [])


def reads_e2b_data(cfg: DictConfig) -> bool:
    """Whether a task the run reads (its data, a curriculum stage, the inference eval
    without its own logs) reads the built E2B data."""
    return built.DATASET in data_builds(cfg)


def prepare_data(cfg: DictConfig) -> None:
    """Build the data a run reads (data_builds) before JAX starts: with capibara-exp-data,
    the builds' one trigger (tasks only read them). The E2B builder executes code in
    subprocesses, and forking a process that runs JAX is unsafe (and JAX warns each time)."""
    needs = data_builds(cfg)
    data_dir = os.environ.get(DATA_DIR_ENV) or cfg.data_dir
    if corpus.CORPUS_NAME in needs:
        corpus.build_corpus(data_dir)  # its own phase line, when it builds
    if built.DATASET in needs:
        from capibara_exp.data.e2b import build

        with phases.phase(f"building the routing data under {data_dir} (first use only)"):
            build.ensure_built(data_dir)


def run(cfg: DictConfig, run_dir: Path, choices: dict[str, str | None],
        multirun: bool = False) -> dict | None:
    """The task function behind `capibara-exp`: the final train_eval metrics.

    `run_dir` is the run's directory (model_dir when given), `choices` the chosen option of
    each config group (for messages), `multirun` whether this is one job of several in
    this process. Nothing is read from Hydra's global state."""
    environment.set_log_levels(bool(cfg.get("verbose")))
    run_dir = Path(run_dir).absolute()
    distributed.check(cfg.distributed, cfg.get("model_dir") is None)
    if cfg.engine.name == "tpu_vm":
        return launch_tpu_vm(cfg, run_dir, choices)
    cfg = with_model_dir(cfg, run_dir)
    # On a TPU host libtpu reads its flags once, when JAX starts it (here, or in T5X's child)
    topologies.export_libtpu_flags(cfg.get("libtpu_init_args"))
    if cfg.engine.name == "t5x":
        cfg = _t5x_resume(cfg, run_dir)
    os.environ[DATA_DIR_ENV] = str(cfg.data_dir)
    path = write_gin(cfg, run_dir, choices, lambda: prepare_data(cfg))
    say(f"run dir {run_dir}")
    metrics = None
    if cfg.engine.name == "local":
        from capibara_exp.runtime import gin_utils
        from capibara_exp.runtime.metrics import final_metrics

        distributed.initialize(cfg.distributed)
        compilation_cache(cfg.get("compilation_cache_dir"))
        peers.agree_on_cache(cfg.get("compilation_cache_dir"))
        phases.show_compiles()
        _share_inputs(multirun)
        with machine_peak(run_dir, cfg.model.get("dtype", "float32"),
                          cfg.get("compilation_cache_dir")), peers.watched(cfg.distributed):
            gin_utils.run_train(path, actions=_sweep_actions(cfg))
        metrics = final_metrics(run_dir)
    elif cfg.engine.name == "t5x":
        metrics = run_t5x(cfg, path, run_dir)
    else:
        raise ConfigError(f"engine.name: unknown engine '{cfg.engine.name}'")
    say(f"done; run dir {run_dir}")
    return metrics


def _t5x_resume(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """What T5X needs to continue the run dir's checkpoints, as gin_bindings (in config.gin)."""
    from capibara_exp.launch import t5x_engine

    extra = t5x_engine.resume_bindings(run_dir, cfg.checkpoint.get("initial_checkpoint"))
    if extra:
        with open_dict(cfg):
            cfg.gin_bindings = [*cfg.get("gin_bindings", []), *extra]
    return cfg


@contextlib.contextmanager
def machine_peak(run_dir: Path, dtype: str, cache_dir: str | None) -> Iterator[None]:
    """This machine's matmul peak (the MFU baseline, runtime/metrics.py), measured once per
    machine, devices and dtype: kept beside the compile cache and handed to each new run dir,
    so a run does not measure again what an earlier one did. Off with the compile cache.
    A kept or run-dir figure measured before the last boot, or beaten by a quick probe now
    (it was measured on a busy machine), is measured again; the figure and its method are
    said once, and written beside each MFU (mfu_peak_flops)."""
    import socket

    import jax

    from capibara_exp.runtime.metrics import PEAK_FILE, run_peak_flops

    devices = jax.devices()
    name = (f"{socket.gethostname()}-{devices[0].platform}-{devices[0].device_kind}-"
            f"{len(devices)}-{dtype}.json").replace(" ", "_").replace("/", "_")
    kept = Path(cache_dir).parent / "peak_flops" / name if cache_dir else None
    run_file = run_dir / PEAK_FILE
    if jax.process_index() == 0:
        for path in (run_file, kept):
            if path and path.is_file() and not peak_still_true(path, dtype):
                path.unlink()
        if kept and kept.is_file() and not run_file.exists():
            shutil.copy(kept, run_file)
        run_peak_flops(run_dir, dtype)
        say(peak_line(run_file))
    yield
    if kept and run_file.is_file() and not kept.is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_file, kept)


PROBE_MARGIN = 1.2  # a probe this much faster than the kept peak: that peak was measured busy


def peak_still_true(path: Path, dtype: str) -> bool:
    """Whether a kept peak still holds: measured since the last boot (/proc/stat's btime)
    and not beaten by a quick 1024^3 matmul probe now (a smaller matmul reaches less of the
    peak, so beating it by the margin means the kept figure was measured under load)."""
    import json

    from capibara_exp.runtime.metrics import matmul_peak_flops

    stored = json.loads(path.read_text())
    if stored.get("dtype", "float32") != dtype:
        return True  # run_peak_flops measures the other dtype itself
    if stored.get("measured_at", 0.0) < boot_time():
        return False
    probe = matmul_peak_flops(n=1024, repeats=3, dtype=dtype)
    return probe <= float(stored["matmul_peak_flops"]) * PROBE_MARGIN


def boot_time() -> float:
    """When this machine booted (seconds since the epoch; 0 where /proc/stat is absent)."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def peak_line(run_file: Path) -> str:
    """The MFU baseline in words: figure, method, when."""
    import json
    import time

    stored = json.loads(run_file.read_text())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(stored.get("measured_at", 0)))
    method = stored.get("method", "a matmul peak measured before methods were recorded")
    return (f"MFU against {stored['matmul_peak_flops'] / 1e9:.1f} GFLOP/s per device: {method}, "
            f"measured {when} (peak_flops.json)")


def say(message: str) -> None:
    print(f"capibara-exp: {message}", file=sys.stderr, flush=True)
    environment.copy_to_run_log(f"capibara-exp: {message}")


def with_model_dir(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """The config with model_dir = the run dir (where Hydra put the run: model_dir itself
    when it was given), absolute, as config.gin's MODEL_DIR."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.model_dir = str(run_dir)
    return cfg


def compilation_cache(directory: str | None) -> None:
    """Point XLA's persistent cache at `directory`; every program goes in, however quick."""
    if not directory:
        return
    import jax

    Path(directory).mkdir(parents=True, exist_ok=True)

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _share_inputs(multirun: bool) -> None:
    """The jobs of a multirun that run in this process (the sweeper's trials, Hydra's basic
    launcher) read the same data: later ones replay the batches earlier ones made."""
    if multirun:
        from capibara_exp.runtime import inputs

        inputs.share_across_runs()


def _sweep_actions(cfg: DictConfig) -> dict | None:
    """The pruning action of a sweep trial (T5X's actions mapping), if this run is one."""
    trial = cfg.get("sweep_trial")
    if not trial:
        return None
    from capibara_exp.sweeping.pruning import OptunaPruning

    return {"TRAIN_EVAL": [OptunaPruning(trial.storage, trial.study_name, int(trial.number),
                                         trial.metric, trial.pruner)]}


def t5x_command(cfg: DictConfig, gin_path: Path) -> list[str]:
    """What engine=t5x runs: T5X's train script with the run's gin (engine.python, default
    the interpreter running capibara-exp)."""
    from capibara_exp.launch import t5x_engine

    return t5x_engine.command(cfg.engine.python, gin_path,
                              [*distributed.t5x_flags(cfg.distributed), *cfg.engine.extra_flags])


def launch_tpu_vm(cfg: DictConfig, run_dir: Path, choices: dict[str, str | None]) -> None:
    """engine=tpu_vm: config.gin for the workers' runtime and the launch script in the run
    dir; print the script (dry run) or run it."""
    if cfg.get("model_dir") is None:  # the default: on the slice's shared storage
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.model_dir = cfg.engine.model_dir
    topology = tpu_vm.check(cfg)
    gin_path = write_gin(cfg, run_dir, choices)
    launch = run_dir / tpu_vm.SCRIPT
    launch.write_text(tpu_vm.script(cfg, topology, str(gin_path), run_dir.name,
                                    data_builds(cfg)))
    launch.chmod(0o755)
    if cfg.engine.dry_run:
        print(launch.read_text())
        print(f"capibara-exp: dry run; the launch script is {launch} "
              "(engine.dry_run=false runs it)", file=sys.stderr)
        return
    if shutil.which("gcloud") is None:
        raise ConfigError("engine=tpu_vm: gcloud is not installed here; install the Google "
                          f"Cloud CLI, or run {launch} where it is")
    result = subprocess.run(["bash", str(launch)], check=False)
    if result.returncode:
        raise RunError(f"{launch} exited with status {result.returncode}; see its output above")


def run_t5x(cfg: DictConfig, gin_path: Path, run_dir: Path) -> dict | None:
    """Launch real T5X on the rendered gin; the run dir ends as the local engine's does."""
    from capibara_exp.launch import t5x_engine

    t5x_engine.check_installed()
    return t5x_engine.run(t5x_command(cfg, gin_path), gin_path, run_dir,
                          int(cfg.trainer.train_steps), bool(cfg.get("verbose")),
                          cfg.get("compilation_cache_dir"))
