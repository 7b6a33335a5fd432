"""What `capibara-exp` checks before Hydra starts the job (so a mistake leaves no run dir):
the composed values (config_check), the T5X gin flags, a sweep's search space, and for a
run the rendered config.gin, parsed against the engine's configurables."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from capibara_exp.base import environment
from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import GIN_DIR
from capibara_exp.cli import compose as composing
from capibara_exp.cli.flags import CommandLine
from capibara_exp.composing import config_check, config_schema
from capibara_exp.composing.config_check import Composition

# gin (gin_bridge, gin_flags), the sweep's and the cross-key rules load where they are used:
# a command line refused while composing (a key typo) never needs them

GIN_LIST_KEYS = ("gin_files", "gin_bindings", "gin_search_paths")


def compose_checked(line: CommandLine, config_name: str,
                    extra: list[str] = ()) -> tuple[Composition, list[str]]:
    """The composed, checked config of a command line, and the overrides Hydra gets (T5X's
    gin flags appended to the lists they extend)."""
    overrides = [*line.overrides, *extra]
    if line.has_gin_flags:
        from capibara_exp.base.overrides import override

        first = composing.compose(config_name, overrides, line.config_dirs, line.multirun)
        overrides = [o for o in overrides if o.lstrip("+~").split("=")[0] not in GIN_LIST_KEYS]
        for key in GIN_LIST_KEYS:
            given = list(first.cfg.get(key) or []) + list(getattr(line, key))
            if given:
                overrides.append(override(key, [_absolute_gin_file(key, v) for v in given]))
    comp = composing.compose(config_name, overrides, line.config_dirs, line.multirun,
                             cached=True)
    config_check.check(comp, missing_ok=line.shows_config)  # --cfg shows ??? as Hydra does
    composing.keep(comp)  # its values pass: the next command with this line reuses it
    return comp, overrides


def _absolute_gin_file(key: str, value: str) -> str:
    """gin files given on the command line, made absolute when found from here (the run
    may read them from another directory: a sweep's workers, T5X)."""
    return str(Path(value).absolute()) if key == "gin_files" and Path(value).is_file() \
        else value


def check_run(comp: Composition, line: CommandLine,
              starting: Callable[[], None] = lambda: None,
              copy: DictConfig | None = None) -> None:
    """capibara-exp's checks beyond the values: sweeps, engines, the rendered gin.
    `starting()` runs once the light checks pass, before the data build and the imports of
    TensorFlow, JAX and SeqIO (what is found before it stays one line). `copy`: the config's
    `without_hydra` copy, where the caller made one (the checks change it)."""
    cfg = without_hydra(comp.cfg) if copy is None else copy
    if line.multirun:
        check_sweep(comp)
        if cfg.get("model_dir") is not None:
            raise ConfigError(f"model_dir={cfg.model_dir} with -m: every job would write that "
                              "one dir; leave model_dir unset (each job gets its own)")
    from capibara_exp.launch import distributed

    distributed.check(cfg.distributed, cfg.get("model_dir") is None)
    if cfg.engine.name == "t5x":
        from capibara_exp.launch import t5x_engine

        t5x_engine.check_installed()
    if cfg.engine.name == "tpu_vm":
        from capibara_exp.launch import tpu_vm

        cfg = _bind_model_dir(cfg, cfg.get("model_dir") or cfg.engine.model_dir)
        tpu_vm.check(cfg)
    else:
        cfg = _bind_model_dir(cfg, str(Path(comp.cfg.hydra.run.dir).absolute()))
    from capibara_exp.cli import gin_flags
    from capibara_exp.composing import gin_bridge

    text = gin_bridge.render(cfg, "local", GIN_DIR, sources(comp))
    gin_flags.check(comp, cfg, text, line.gin_flags)
    starting()
    if line.multirun or line.shows_config or cfg.engine.name == "tpu_vm":
        return
    from capibara_exp import experiment

    os.environ[experiment.DATA_DIR_ENV] = str(cfg.data_dir)
    experiment.prepare_data(cfg)  # before JAX loads: the build forks
    from capibara_exp.base import phases

    with phases.phase("importing TensorFlow, JAX and SeqIO to check config.gin"):
        environment.import_tensorflow(bool(cfg.get("verbose")))
        from capibara_exp.runtime import gin_utils

        gin_utils.parse(experiment.CONFIG_GIN, text)  # the file the run will write


def sources(comp: Composition) -> dict[str, str]:
    """Group -> the file that chose its values, for the bridge's messages."""
    out = {"root": str(comp.primary)}
    for group in comp.choices:
        if not group.startswith("hydra"):
            out[group] = comp.option_file(group)
    return out


def without_hydra(cfg: DictConfig) -> DictConfig:
    """A copy of the config without its `hydra` node (not copied: it is half the config),
    with the root's struct and read-only flags."""
    copy = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    OmegaConf.set_struct(copy, OmegaConf.is_struct(cfg))
    if OmegaConf.is_readonly(cfg):
        OmegaConf.set_readonly(copy, True)
    return copy


def _bind_model_dir(cfg: DictConfig, model_dir: str) -> DictConfig:
    """model_dir set in `cfg`, check_run's own copy (without_hydra's)."""
    with open_dict(cfg):
        cfg.model_dir = model_dir
    return cfg


def check_sweep(comp: Composition) -> None:
    """Every value a sweep can give a key must be one the key allows: each choice, both ends
    of an interval or range; a config group's options must exist; the sweeper's settings."""
    hydra = comp.cfg.hydra
    if "capibara_optuna" not in str(hydra.sweeper.get("_target_", "")):
        return
    params = hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=True) if params is not None else {}
    task = list(hydra.overrides.task)
    from capibara_exp.sweeping import search_space, study

    settings = {k: v for k, v in OmegaConf.to_container(hydra.sweeper, resolve=True).items()
                if k != "_target_"}
    study.SweepSettings(**settings)
    searched = search_space.parse([*(f"{k}={v}" for k, v in params.items()), *task])
    if not searched.distributions:
        raise ConfigError("hydra.sweeper.params and the command line define no search "
                          "dimension (use choice(...), range(...), interval(...))")
    from capibara_exp.base import optuna_study

    sampler, names = settings.get("sampler"), optuna_study.SAMPLER_NAMES
    if sampler not in names:
        raise ConfigError(f"hydra.sweeper.sampler={sampler}: not one of {', '.join(names)}"
                          f"{config_check.did_you_mean(str(sampler), names)}")
    for key, dist in searched.distributions.items():
        for value in _sweep_values(dist):
            _check_swept(comp, key, value)
    metric, ks = settings.get("metric"), OmegaConf.select(comp.cfg, "infer_eval.infer_eval_pass_ks")
    from capibara_exp.composing import cross_rules

    problem = cross_rules.unreported_pass_at_k(
        metric, OmegaConf.to_container(ks) if ks is not None else None)
    if problem:
        raise ConfigError(f"hydra.sweeper.metric={metric}: {problem}")


def _sweep_values(dist: object) -> list:
    choices = getattr(dist, "choices", None)
    if choices is not None:
        return list(choices)
    return [dist.low, dist.high]


def _check_swept(comp: Composition, key: str, value: object) -> None:
    group = key.lstrip("+")
    if group in comp.choices:
        if not any((d / group / f"{value}.yaml").is_file() for d in comp.search_dirs):
            raise ConfigError(f"{key}: the sweep's option '{value}' is not in {group}/")
        return
    rule = config_schema.rule_for(comp.config_name, group, comp.defaults.get(group))
    if group not in comp.defaults and rule is None:
        raise ConfigError(f"hydra.sweeper.params: unknown key '{group}'"
                          f"{config_check.did_you_mean(group, comp.defaults)}")
    problem = rule.problem(value) if rule else None
    if problem:
        raise ConfigError(f"{group}: the sweep can give it {value}, but it must be {problem}")
