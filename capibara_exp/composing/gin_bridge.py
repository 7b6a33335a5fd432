"""The gin bridge: a composed Hydra config in, one self-contained T5X-dialect gin file out.

gin/ templates give structure and declare their inputs as `MACRO = %gin.REQUIRED`; conf/
gives values. Every key of a gin-facing group is the macro of the same name in capitals
(`model.emb_dim` -> `EMB_DIM`). The bridge inlines the templates (and their `include`s)
under the engine's import header, then binds each macro once, so a value lives in one
place. This module is pure: no gin, no JAX, only text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from capibara_exp.base.errors import ConfigError
from capibara_exp.composing import gin_actions

GIN_GROUPS = ("trainer", "data", "model", "optimizer", "schedule", "partitioning", "checkpoint")
# Groups that are off (null) unless chosen; when chosen they work like the groups above.
OPTIONAL_GROUPS = ("early_stopping", "ema", "nan_guard", "curriculum", "router_supervision",
                   "lora", "monitor", "consensus", "wandb", "mlflow", "infer_eval")
# Features T5X does not have: their templates bind the local engine's own names.
LOCAL_ONLY_GROUPS = ("ema", "nan_guard", "curriculum", "router_supervision", "lora",
                     "monitor")
ROOT_MACROS = ("model_dir", "random_seed")
TEMPLATE_KEY = "template"

# The only lines that differ between engines. Alias names must match one for one.
ENGINE_HEADERS: dict[str, tuple[str, ...]] = {
    "t5x": (
        "import __main__ as train_script",
        "from t5x import gin_utils",
        # T5X's model classes drawing the inference eval's samples (generation/t5x_models.py)
        "from capibara_exp.generation import t5x_models as models",
        "from t5x import optimizers",
        "from t5x import partitioning",
        "from t5x import trainer",
        "from t5x import utils",
        "import optax as hyperparams",
        "from capibara_exp.generation import t5x_moe_models as moe_models",
        "from t5x.contrib.moe import partitioning as moe_partitioning",
        "from t5x.contrib.moe import trainer as moe_trainer",
    ),
    "local": (
        "from capibara_exp.runtime import train_script",
        "from capibara_exp.runtime import gin_utils",
        "from capibara_exp.runtime import models",
        "from capibara_exp.runtime import optimizers",
        "from capibara_exp.runtime import partitioning",
        "from capibara_exp.runtime import trainer",
        "from capibara_exp.runtime import utils",
        # optax whose numbers are optimizer state: a sweep's trials share one compiled step
        "from capibara_exp.runtime import hyperparams",
        # one module holds t5x.contrib.moe's model, partitioner and trainer
        "from capibara_exp.runtime import contrib_moe as moe_models",
        "from capibara_exp.runtime import contrib_moe as moe_partitioning",
        "from capibara_exp.runtime import contrib_moe as moe_trainer",
    ),
}
COMMON_IMPORTS = (
    "from capibara_exp import nets",
    "import seqio",
)
BODY_MARKER = "# ---- body: identical for every engine ----"
BINDING_MARK = "# gin_bindings["  # + "<i>]: <key>" before each of gin_bindings' lines

_REQUIRED_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=\s*%gin\.REQUIRED\s*(#.*)?$")
_INCLUDE_RE = re.compile(r"""^include\s+(['"])(.+)\1\s*$""")
_IMPORT_RE = re.compile(r"^(?:from\s+\S+\s+)?import\s+(\S+)(?:\s+as\s+(\w+))?\s*(?:#.*)?$")
_REFERENCE_RE = re.compile(r"^(@[A-Za-z_][\w./]*(\(\))?|%[A-Za-z_][\w.]*)$")
_ACTIONS_BINDING_RE = re.compile(r"^train_script\.train\.actions\s*=", re.M)
_BINDING_KEY_RE = re.compile(r"^([\w.]+/)*[A-Za-z_][\w.]*\.[A-Za-z_]\w*$|^[A-Z_][A-Z0-9_]*$")


class GinReference(str):
    """A string that renders as a gin reference (`@name`, `@name()`, `%MACRO`), not a literal."""


@dataclass(frozen=True)
class Template:
    """One gin template file, with its includes already inlined."""

    name: str
    group: str
    text: str
    required: tuple[str, ...]


def to_gin_literal(value: object, where: str = "value") -> str:
    """Render a Python value as gin text that parses back to the same value."""
    if isinstance(value, GinReference):
        if not _REFERENCE_RE.match(value):
            raise ConfigError(f"{where}: {value!r} is not a gin reference (@name, @name(), %MACRO)")
        return str(value)
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {value!r} has no gin literal (only finite floats)")
        return repr(float(value))
    if isinstance(value, str):
        if _REFERENCE_RE.match(value):
            return value
        return repr(value)
    if isinstance(value, tuple):
        items = [to_gin_literal(v, where) for v in value]
        return "(" + items[0] + ",)" if len(items) == 1 else "(" + ", ".join(items) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(to_gin_literal(v, where) for v in value) + "]"
    if isinstance(value, dict):
        parts = []
        for k, v in value.items():
            if not isinstance(k, (str, int, bool)) or isinstance(k, GinReference):
                raise ConfigError(f"{where}: dict key {k!r} must be a string or an int")
            key = repr(k) if isinstance(k, str) else to_gin_literal(k, where)  # never a reference
            parts.append(f"{key}: {to_gin_literal(v, where)}")
        return "{" + ", ".join(parts) + "}"
    raise ConfigError(f"{where}: {type(value).__name__} value {value!r} cannot be written in gin")


def load_template(name: str, group: str, templates_dir: Path,
                  _seen: tuple[str, ...] = ()) -> Template:
    """Read gin/<name> and inline its `include` lines (each file once, cycles are errors)."""
    path = templates_dir / name
    if name in _seen:
        raise ConfigError(f"gin/{name}: include cycle {' -> '.join((*_seen, name))}")
    if not path.is_file():
        raise ConfigError(f"{group}.{TEMPLATE_KEY}: gin template gin/{name} does not exist")
    lines, required = [], []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        inc = _INCLUDE_RE.match(line.strip())
        if inc:
            sub = load_template(inc.group(2), group, templates_dir, (*_seen, name))
            lines += [f"# (included from gin/{name}:{lineno}) gin/{sub.name}", sub.text]
            required += sub.required
            continue
        req = _REQUIRED_RE.match(line.strip())
        if req:
            required.append(req.group(1))
        lines.append(line)
    return Template(name, group, "\n".join(lines).rstrip() + "\n", tuple(required))


def _container(node: object) -> object:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig,)) else node


def render_body(cfg: DictConfig, templates_dir: Path,
                sources: Mapping[str, str] | None = None) -> str:
    """The engine-independent part of config.gin: templates, then macro values, then extras."""
    sources = dict(sources or {})
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        keys = ", ".join(sorted(missing))
        raise ConfigError(f"missing mandatory value (???) for: {keys}; set it on the command line")

    templates: list[Template] = []
    values: dict[str, tuple[str, object]] = {}  # MACRO -> (conf key, value)
    for group in GIN_GROUPS + OPTIONAL_GROUPS:
        node = cfg.get(group)
        if node is None and group in OPTIONAL_GROUPS:
            continue
        if node is None:
            raise ConfigError(f"config group '{group}' is not set (conf/{group}/)")
        group_values = _container(node)
        template = group_values.pop(TEMPLATE_KEY, None)
        if template:
            templates.append(load_template(template, group, templates_dir))
        for key, value in group_values.items():
            _add_macro(values, f"{group}.{key}", value, sources.get(group, f"conf/{group}/"))
    for key in ROOT_MACROS:
        _add_macro(values, key, cfg.get(key), sources.get("root", "conf/config.yaml"))

    declared = {m: t for t in templates for m in t.required}
    for macro, (key, _) in values.items():
        if macro not in declared:
            group = key.split(".")[0] if "." in key else "root"
            names = ", ".join(f"gin/{t.name}" for t in templates)
            raise ConfigError(
                f"unknown key '{key}' ({sources.get(group, 'conf/')}): no included gin template "
                f"declares {macro} = %gin.REQUIRED (templates: {names})"
            )
    for macro, template in declared.items():
        if macro not in values:
            raise ConfigError(
                f"gin/{template.name} requires {macro}: set {template.group}.{macro.lower()} "
                f"({sources.get(template.group, f'conf/{template.group}/')})"
            )

    out = [BODY_MARKER]
    for t in templates:
        out += [f"# ===== gin/{t.name} (group: {t.group})", t.text]
    out.append("# ===== values from conf/ (fill the %gin.REQUIRED macros above)")
    for macro, (key, value) in values.items():
        out.append(f"{macro} = {to_gin_literal(value, key)}  # {key}")
    out += _user_parts(cfg, templates)
    return "\n".join(out) + "\n"


def _user_parts(cfg: DictConfig, templates: list[Template]) -> list[str]:
    """gin_files, gin_bindings and the one actions binding joining the templates' actions
    with the user's (composing/gin_actions.py)."""
    _check_actions(templates)
    out: list[str] = []
    user_files = _gin_files(cfg)
    for _, lines in user_files:
        out += lines
    extra = OmegaConf.to_container(cfg.gin_bindings) if cfg.get("gin_bindings") else []
    user_texts = [(where, "\n".join(lines)) for where, lines in user_files]
    if extra:
        out.append("\n# ===== gin_bindings (applied last)")
        for i, binding in enumerate(extra):
            key, eq, value = str(binding).partition("=")
            if not eq or not _BINDING_KEY_RE.match(key.strip()) or not value.strip():
                raise ConfigError(f"gin_bindings[{i}]: {binding!r} is not a gin binding "
                                  "'scope/name.param = value'")
            # The marker names the entry, for errors about this line (runtime/gin_utils.py).
            out += [f"{BINDING_MARK}{i}]: {key.strip()}", f"{key.strip()} = {value.strip()}"]
            user_texts.append((f"gin_bindings[{i}]", f"{key.strip()} = {value.strip()}"))
    user_macros: dict[str, list[str]] = {}
    for _, text in user_texts:
        for mode, refs in gin_actions.template_actions(text).items():
            user_macros.setdefault(mode, []).extend(refs)
    binding = gin_actions.last_user_binding(user_texts)
    joined = gin_actions.join(gin_actions.template_actions("\n".join(t.text for t in templates)),
                              user_macros, binding)
    # After the user's binding, which it must override; else before the user's lines, so a
    # binding left open in gin_bindings ends the file (gin's error then says so).
    return out + joined if binding else joined + out


def find_gin_file(name: str, search_paths: list[str], where: str) -> Path:
    """A gin file as gin finds one: the path itself (relative to the current directory),
    then under each search path (T5X's --gin_search_paths)."""
    for base in ("", *search_paths):
        path = Path(base, name) if base else Path(name)
        if path.is_file():
            return path.absolute()
    looked = ", ".join(["the current directory", *search_paths])
    raise ConfigError(f"{where}: gin file '{name}' not found (looked in {looked})")


def _gin_files(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """gin_files (T5X's --gin_file), inlined in order after the rendered config: their
    includes inlined too, and their import lines for the header's names left to the
    engine header (so a file written for T5X binds the local engine's modules too).
    [(gin_files[i], its lines)]."""
    files = list(cfg.get("gin_files") or [])
    search = [str(p) for p in (cfg.get("gin_search_paths") or [])]
    out = []
    for i, name in enumerate(files):
        path = find_gin_file(str(name), search, f"gin_files[{i}]")
        out.append((f"gin_files[{i}] ({path})", [
            f"\n# ===== gin_files[{i}]: {path} (applied after the rendered config)",
            *_user_gin_lines(path, search, (str(path),))]))
    return out


def read_gin_text(path: Path) -> str:
    """A user's gin file as text; one that is not UTF-8 (binary, UTF-16) is named."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a gin file (not UTF-8 text: byte {err.start} is "
                          f"{data[err.start:err.start + 1]!r})") from None
    if "\0" in text:
        raise ConfigError(f"{path}: not a gin file (it holds NUL bytes)")
    return text


def _user_gin_lines(path: Path, search: list[str], seen: tuple[str, ...]) -> list[str]:
    aliases = {line.split()[-1] for line in ENGINE_HEADERS["local"] + COMMON_IMPORTS}
    lines = []
    for lineno, line in enumerate(read_gin_text(path).splitlines(), start=1):
        stripped = line.strip()
        inc = _INCLUDE_RE.match(stripped)
        imported = _IMPORT_RE.match(stripped)
        if inc:
            sub = find_gin_file(inc.group(2), [*search, str(path.parent)], f"{path}:{lineno}")
            if str(sub) in seen:
                raise ConfigError(f"{path}:{lineno}: include cycle "
                                  f"{' -> '.join((*seen, str(sub)))}")
            lines += [f"# (included from {path}:{lineno}) {sub}",
                      *_user_gin_lines(sub, search, (*seen, str(sub)))]
        elif imported and (imported.group(2) or imported.group(1).split(".")[-1]) in (
                *aliases, "dynamic_registration"):
            lines.append(f"# (the engine header provides: {stripped})")
        else:
            lines.append(line)
    return lines


def _check_actions(templates: list[Template]) -> None:
    """Templates name their actions `<MODE>_ACTION_<NAME> = @...` (composing/gin_actions.py joins
    them, with the user's, into one `train_script.train.actions`); none binds it itself."""
    for t in templates:
        if _ACTIONS_BINDING_RE.search(t.text):
            raise ConfigError(f"gin/{t.name} binds train_script.train.actions itself; name its "
                              "action TRAIN_EVAL_ACTION_<NAME> = @... so actions can be joined")


def _add_macro(values: dict, key: str, value: object, source: str) -> None:
    macro = key.split(".")[-1].upper()
    if macro in values:
        raise ConfigError(f"keys '{values[macro][0]}' and '{key}' both set gin macro {macro} "
                          f"({source})")
    values[macro] = (key, value)


def header(engine: str) -> str:
    """The import header of config.gin for an engine."""
    if engine not in ENGINE_HEADERS:
        raise ConfigError(f"engine.name: unknown engine '{engine}' "
                          f"(choose from {sorted(ENGINE_HEADERS)})")
    lines = ["from __gin__ import dynamic_registration", *ENGINE_HEADERS[engine], *COMMON_IMPORTS]
    return "\n".join(lines) + "\n"


def render(cfg: DictConfig, engine: str, templates_dir: Path,
           sources: Mapping[str, str] | None = None, title: str = "") -> str:
    """The whole config.gin: a comment, the engine's header, and the shared body."""
    chosen = [g for g in LOCAL_ONLY_GROUPS if cfg.get(g) is not None]
    if engine != "local" and chosen:
        raise ConfigError(f"{', '.join(chosen)}: the local engine's own feature(s), which T5X "
                          f"does not have; run with engine=local or drop {chosen[0]}=...")
    intro = [f"# config.gin rendered by capibara-exp for engine={engine}."]
    if title:
        intro.append(f"# {title}")
    intro.append("# Re-run the command to regenerate; edits here are not read back into conf/.")
    body = render_body(cfg, templates_dir, sources)
    return "\n".join(intro) + "\n" + header(engine) + "\n" + body


def body_of(gin_text: str) -> str:
    """The engine-independent part of a rendered config.gin."""
    _, sep, body = gin_text.partition(BODY_MARKER)
    if not sep:
        raise ConfigError("not a config.gin rendered by capibara-exp (no body marker)")
    return body
