"""Command lines generated from the config schema, each wrong in one way (a value of the wrong
type or out of range, an unknown key, an option that does not exist, a malformed gin flag):
every one must end in one line on stderr and exit status 2, before any run dir exists.

They run through capibara-exp's own `main` in this process (what the console script runs,
without starting a Python per line); a line that passed the checks would reach Hydra's job,
which here fails the test instead of training.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli import main as cli
from capibara_exp.composing import config_schema
from capibara_exp.composing.config_schema import Rule
from tests.conftest import compose_config
from tests.test_cli import error_lines

# The group options under which a key exists (its group is off or another option otherwise).
CONTEXT = {"model.num_experts": ["model=moe_tiny"], "engine.python": ["engine=t5x"],
           "early_stopping.": ["early_stopping=default"], "ema.": ["ema=default"],
           "nan_guard.": ["nan_guard=skip"],
           "lora.": ["lora=default", "lora.lora_base_checkpoint=x"],
           "router_supervision.": ["router_supervision=domain", "model=moe_tiny"],
           "consensus.": ["consensus=last_k"], "tune_mesh.": ["+tune_mesh=default"],
           "engine.": ["engine=tpu_vm", "engine.tpu_name=t", "engine.zone=z", "engine.workdir=/w"]}
MOE_KEYS = ("capacity_factor", "eval_capacity_factor", "min_expert_capacity", "moe_layer_interval",
            "router_jitter_noise", "expert_dropout_rate", "aux_loss_factor", "router_z_loss_factor",
            "loss_normalizing_factor", "num_selected_experts", "num_experts")


def context(key: str) -> list[str]:
    if key.startswith("model.") and key.split(".")[1] in MOE_KEYS:
        return CONTEXT["model.num_experts"]
    if key == "engine.python":
        return CONTEXT[key]
    for prefix, args in CONTEXT.items():
        if prefix.endswith(".") and key.startswith(prefix):
            return args
    return []


def bad_values(rule: Rule) -> list[str]:
    """Override values the rule refuses: another type, each bound crossed, a wrong choice,
    null where null is not allowed."""
    out = []
    if rule.choices:
        out.append("not_an_option" if rule.kind != "int" else "7")
    elif rule.kind in ("int", "float"):
        out.append("fast")
        if rule.kind == "int":
            out.append("1.5")
        for bound, step in ((rule.ge, -1), (rule.gt, 0), (rule.le, 1), (rule.lt, 0)):
            if bound is not None:
                value = bound + step
                out.append(str(int(value)) if rule.kind == "int" and float(value).is_integer()
                           else repr(float(value)))
    elif rule.kind == "bool":
        out.append("maybe")
    elif rule.kind == "list":
        out.append("not_a_list")
    elif rule.kind == "map":
        out.append("[1,2]")
    elif rule.kind == "str":
        out.append("[1,2]")
    if not rule.null and rule.kind != "any":
        out.append("null")
    return out


def value_cases(per_rule: int | None = None) -> list[list[str]]:
    """Bad values of every rule: all of them, or `per_rule` of each (taking turns through
    the kinds of mistake, so that every kind is among them)."""
    cases = []
    for n, (key, rule) in enumerate(config_schema.RULES.items()):
        if key in ("gin_files", "gin_search_paths", "gin_bindings", "sweep_trial", "model_dir",
                   "compilation_cache_dir", "engine.model_dir"):
            continue  # paths and lists of strings: any string is a path or a binding
        values = bad_values(rule)
        if per_rule is not None:
            values = [values[(n + i) % len(values)] for i in range(min(per_rule, len(values)))]
        cases += [[*context(key), f"{key}={value}"] for value in values]
    return cases


def typo(name: str) -> str:
    """The name with two neighbouring letters swapped (or a letter doubled)."""
    for i in range(len(name) - 1):
        if name[i] != name[i + 1] and name[i].isalpha() and name[i + 1].isalpha():
            return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return name + name[-1]


def key_cases() -> list[list[str]]:
    cfg = compose_config(["model_dir=/x"])
    cases = []
    for group in ("model", "data", "optimizer", "schedule", "trainer", "partitioning",
                  "checkpoint"):
        for key in cfg[group]:
            group_part, key_part = (typo(group), key) if len(cases) % 3 == 0 else (group, typo(key))
            cases.append([f"{group_part}.{key_part}=1"])
    cases += [[f"+{typo(k)}=1"] for k in ("random_seed", "data_dir", "topology", "name")]
    # a key added with + that no file of the group has (a YAML file adding one is the same)
    for group in ("model", "data", "optimizer", "schedule", "trainer", "partitioning",
                  "checkpoint", "engine", "early_stopping", "ema", "nan_guard", "consensus"):
        cases.append([*context(f"{group}.x"), f"+{group}.{group}_setting=1"])
    return cases


def option_cases() -> list[list[str]]:
    cases = []
    for group_dir in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        option = sorted(p.stem for p in group_dir.glob("*.yaml"))[0]
        cases.append([f"{group_dir.name}={option}x"])
    cases.append(["+sweeps=lr_wdd", "-m"])
    cases.append(["+sweep=lr_wd"])
    return cases


GIN_FLAG_CASES = [
    ["--gin.MODEL_DIR"], ["--gin.=3"], ["--gin.TRAIN_STEPS="], ["--gin_file=/no/such.gin"],
    ["--gin_file"], ["--gin_bindings"], ["--gin_bindings=not a binding"],
    ["--gin.nets.DecoderConfig.emb_dim=[1,"], ["--gin_search_paths"], ["--gin_binding=x = 1"],
    ["--gin.nets.DecoderConfig.emb_dim=(1"], ["gin_bindings=['x.y = ']"],
    ["gin_bindings=['= 3']"], ["--gin-file=a.gin"],
]


def sweep_cases() -> list[list[str]]:
    return [["-m", "hydra/sweeper=capibara_optuna", "trainer.train_steps=choice(4, -2)"],
            ["-m", "hydra/sweeper=capibara_optuna", "schedule.base_learning_rate=interval(0, 1)"],
            ["-m", "hydra/sweeper=capibara_optuna", "schedule=choice(warmup_rsqrt, nope)"],
            ["-m", "hydra/sweeper=capibara_optuna", "x=interval(1, 1)"],
            ["-m", "+sweeps=lr_wd", "hydra.sweeper.n_trials=0"]]


# Every bad value of every rule would be ~290 lines, each a composition (~0.15 s of CPU):
# one per rule (the kinds taking turns) keeps the file under a minute. Keys, options and
# flags: all of them.
CASES = value_cases(per_rule=1) + key_cases() + option_cases() + GIN_FLAG_CASES + sweep_cases()


def test_there_are_at_least_200_generated_bad_command_lines() -> None:
    assert len(CASES) >= 200, len(CASES)
    assert len({tuple(c) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("args", CASES, ids=[" ".join(c)[:60] for c in CASES])
def test_a_bad_command_line_is_one_line_and_status_2(args: list[str], tmp_path: Path,
                                                    monkeypatch, capsys) -> None:
    def job_started() -> None:
        raise AssertionError(f"{args}: passed the checks and reached Hydra's job")

    monkeypatch.setattr(cli, "_app", job_started)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        cli.main([*args, f"model_dir={run_dir}"] if "-m" not in args else args)
    err = capsys.readouterr().err
    lines = error_lines(err)  # the starting line and phase lines are progress, not errors
    assert stopped.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("capibara-exp: configuration error: "), err
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()
    assert not (tmp_path / "multirun").exists()
    named = [a.split("=")[0].lstrip("+~") for a in args if "=" in a or a.startswith("--")]
    assert any(part in lines[0] for name in named for part in
               (name, name.split(".")[-1], name.lstrip("-"))), (args, lines[0])


def test_the_generated_lines_cover_every_kind_of_mistake() -> None:
    text = yaml.safe_dump(CASES)
    for fragment in ("=fast", "=null", "=not_an_option", "--gin", "=1.5", "x=", "choice("):
        assert fragment in text, fragment
    assert len(list(itertools.chain(key_cases(), option_cases()))) >= 40
