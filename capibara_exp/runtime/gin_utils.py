"""The gin edge of the local engine: parse a config.gin, check it, call train with it."""

from __future__ import annotations

import re
import tokenize
from pathlib import Path
from typing import Any

import gin
from gin import config_parser

from capibara_exp.base.errors import ConfigError, NotBuilt
from capibara_exp.composing.gin_bridge import BINDING_MARK

OPERATIVE_CONFIG = "operative_config.gin"
# The local engine's edge: its DatasetConfigs take the packer config.gin configures
# (data_packing.packer, which T5X never reads), so the input pipeline gets it as an argument.
_PACKER_BINDING = """from __gin__ import dynamic_registration
from capibara_exp.data import packing as data_packing
from capibara_exp.runtime import utils
utils.DatasetConfig.packer = @data_packing.packer()
"""
_TEMPLATE_MARK_RE = re.compile(
    r"^# ===== (gin/\S+|values from conf/|gin_bindings|gin_files\[\d+\]: \S+)")
_BINDING_MARK_RE = re.compile(rf"^{re.escape(BINDING_MARK)}(\d+)\]: (\S+)$")
_LINE_RE = re.compile(r"line (\d+)")
# gin appends this to an exception raised inside a configurable (innermost call first).
_IN_CALL_RE = re.compile(
    r"\n\s*In call to configurable '([^']+)' \(([^\n]*)\)(?: in scope '([^']*)')?")
_PARAM_RE = re.compile(r"\b(?:[A-Za-z_][\w/]*\.)+[a-z_]\w*\b")


def summarize_gin_config(model_dir: str, summary_writer: Any, step: int) -> None:
    """Write the operative config (what was actually used) to model_dir and TensorBoard."""
    text = gin.operative_config_str()
    Path(model_dir, OPERATIVE_CONFIG).write_text(text)
    if summary_writer is not None:
        indented = "    " + text.replace("\n", "\n    ")
        summary_writer.text(step, "train", "operative_config", indented)


def origin(gin_text: str, lineno: int) -> str:
    """Which template, conf key or gin_bindings entry a line of a rendered config.gin came from."""
    lines = gin_text.splitlines()
    source = "the engine header"
    for line in lines[: max(lineno, 1)]:
        mark = _TEMPLATE_MARK_RE.match(line)
        if mark:
            source = mark.group(1)
        entry = _BINDING_MARK_RE.match(line)
        if entry:
            source = f"gin_bindings[{entry.group(1)}], {entry.group(2)}"
    if 0 < lineno <= len(lines) and "  # " in lines[lineno - 1] and source == "values from conf/":
        source = "conf key " + lines[lineno - 1].rsplit("  # ", 1)[1]
    return source


class _SyntaxOnly(config_parser.ParserDelegate):
    """Parses references and macros without looking them up (syntax check of one binding)."""

    def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> str:
        return scoped_configurable_name

    def macro(self, macro_name: str) -> str:
        return macro_name


def check_bindings(path: str | Path, gin_text: str) -> None:
    """Parse each gin_bindings entry of a rendered config.gin on its own, so that an
    unbalanced bracket or a bad literal is reported with the entry, not at end of file."""
    lines = gin_text.splitlines()
    starts = [(n, m) for n, line in enumerate(lines) if (m := _BINDING_MARK_RE.match(line))]
    for k, (n, mark) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(lines)
        binding = "\n".join(lines[n + 1 : end])
        try:
            list(config_parser.ConfigParser(binding, _SyntaxOnly()))
        except (SyntaxError, tokenize.TokenError, ValueError) as err:
            problem = err.msg if isinstance(err, SyntaxError) else str(err.args[0])
            raise ConfigError(f"{path}:{n + 2}: gin_bindings[{mark.group(1)}] ({mark.group(2)}): "
                              f"{problem.strip()}: {binding.strip()!r}") from None


def _error_line(err: Exception, message: str) -> int | None:
    """The config.gin line an exception from gin's parser points at, if it says."""
    if isinstance(err, tokenize.TokenError) and len(err.args) > 1:
        return int(err.args[1][0])  # ('EOF in multi-line statement', (line, col))
    if isinstance(err, SyntaxError) and err.lineno:
        return err.lineno
    found = _LINE_RE.search(message)
    return int(found.group(1)) if found else None


def parse(path: str | Path, gin_text: str | None = None) -> None:
    """Parse a config.gin into gin's global state, or raise ConfigError naming file, line, key."""
    path = Path(path)
    text = gin_text if gin_text is not None else path.read_text()
    check_bindings(path, text)
    gin.clear_config(clear_constants=True)
    try:
        with gin.unlock_config():
            gin.parse_config(text)
            if not _bound("utils.DatasetConfig.packer"):
                gin.parse_config(_PACKER_BINDING)
    except Exception as err:  # gin raises ValueError, SyntaxError, ImportError, KeyError...
        message = str(err).strip()
        lineno = _error_line(err, message)
        message = message.splitlines()[0] if message else type(err).__name__  # gin adds the
        # binding's text and line below, which `where` names
        where = f"{path}"
        if lineno:
            where = f"{path}:{lineno} (from {origin(text, lineno)})"
        raise ConfigError(f"{where}: {type(err).__name__}: {message}") from err


def _bound(selector: str) -> bool:
    try:
        gin.query_parameter(selector)
    except ValueError:
        return False
    return True


def run_bindings(path: str | Path, gin_text: str | None = None) -> dict[str, Any]:
    """A run's pieces as its config.gin builds them: train_script.train's arguments (model,
    data sets, partitioner, trainer class, ...), every reference built by gin. The one way
    the mesh planner, consensus merging and the benches get a run's parts."""
    from capibara_exp.runtime import train_script

    parse(path, gin_text)
    return gin.get_bindings(train_script.train)


def _binding_origin(gin_text: str, message: str, scope: str = "") -> str | None:
    """'LINE (from ...)' for the first parameter named in an error message (`Class.param`,
    `module.Class.param`) that config.gin binds: the line of its macro's value (a conf key)
    or of its binding."""
    lines = gin_text.splitlines()
    for dotted in _PARAM_RE.findall(message):
        parts = dotted.split(".")
        name, param = parts[-2], parts[-1]
        value = None
        for selector in dict.fromkeys([f"{scope}/{name}.{param}" if scope else "",
                                       f"{name}.{param}", dotted]):
            try:
                value = repr(gin.query_parameter(selector)) if selector else None
            except (ValueError, KeyError):
                continue
            if value is not None:
                break
        if value is None:
            continue
        pattern = (rf"^\s*{re.escape(value[1:])}\s*=" if value.startswith("%")
                   else rf"^\s*([\w./]*[./])?{re.escape(name)}\.{re.escape(param)}\s*=")
        hits = [n for n, line in enumerate(lines, start=1) if re.match(pattern, line)]
        if hits:
            return f"{hits[-1]} (from {origin(gin_text, hits[-1])})"
    return None


def _config_error(err: Exception, path: Path, gin_text: str) -> ConfigError | None:
    """A ConfigError for a configuration mistake found once gin calls the configurables: an
    unsupported T5X parameter, or a ValueError/TypeError raised while gin builds an object
    (a configurable other than train itself) or naming a parameter config.gin binds. None
    for an error of the training itself."""
    from capibara_exp.runtime.utils import UnsupportedParameter  # JAX: not before it is needed

    if not isinstance(err, (ValueError, TypeError)):
        return None
    message = str(err)
    calls = _IN_CALL_RE.findall(message)
    text = _IN_CALL_RE.sub("", message).strip()
    name, _, scope = calls[0] if calls else ("", "", "")
    where = _binding_origin(gin_text, text, scope)
    if not (isinstance(err, UnsupportedParameter) or where or (name and name != "train")):
        return None
    if name and name != "train":
        text += f" (in {name}" + (f", scope {scope})" if scope else ")")
    return ConfigError(f"{path}:{where}: {text}" if where else f"{path}: {text}")


def run_train(path: str | Path, actions: dict | None = None) -> Any:
    """Parse config.gin and call the bound train_script.train (plus extra actions by mode)."""
    from capibara_exp.runtime import train_script

    path = Path(path)
    text = path.read_text()
    parse(path, text)
    train = gin.get_configurable(train_script.train)
    kwargs = {}
    if actions:
        # Both the gin-bound actions (e.g. a consensus merge) and the caller's (a sweep
        # trial's pruning) run: the bound ones first, in their modes' order.
        bound = gin.get_bindings(train_script.train).get("actions") or {}
        kwargs["actions"] = {mode: [*bound.get(mode, []), *actions.get(mode, [])]
                             for mode in dict.fromkeys([*bound, *actions])}
    try:
        return train(**kwargs)
    except NotBuilt as err:  # data a task reads not built: its one line, not gin's call notes
        raise NotBuilt(_IN_CALL_RE.sub("", str(err)).strip()) from None
    except Exception as err:
        config_error = _config_error(err, path, text)
        if config_error is None:
            raise
        raise config_error from err
