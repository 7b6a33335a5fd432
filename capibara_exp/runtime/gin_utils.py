"""The gin edge of the local engine: parse a config.gin, check it, call train with it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gin
from capibara_exp.gin_bridge import ConfigError

OPERATIVE_CONFIG = "operative_config.gin"
_TEMPLATE_MARK_RE = re.compile(r"^# ===== (gin/\S+|values from conf/|gin_bindings)")
_LINE_RE = re.compile(r"line (\d+)")


def summarize_gin_config(model_dir: str, summary_writer: Any, step: int) -> None:
    """Write the operative config (what was actually used) to model_dir and TensorBoard."""
    text = gin.operative_config_str()
    Path(model_dir, OPERATIVE_CONFIG).write_text(text)
    if summary_writer is not None:
        summary_writer.text(step, "train", "operative_config", "    " + text.replace("\n", "\n    "))


def origin(gin_text: str, lineno: int) -> str:
    """Which template (or conf key) a line of a rendered config.gin came from."""
    lines = gin_text.splitlines()
    source = "the engine header"
    for line in lines[: max(lineno, 1)]:
        mark = _TEMPLATE_MARK_RE.match(line)
        if mark:
            source = mark.group(1)
    if 0 < lineno <= len(lines) and "  # " in lines[lineno - 1] and source == "values from conf/":
        source = "conf key " + lines[lineno - 1].rsplit("  # ", 1)[1]
    return source


def parse(path: str | Path, gin_text: str | None = None) -> None:
    """Parse a config.gin into gin's global state, or raise ConfigError naming file, line, key."""
    path = Path(path)
    text = gin_text if gin_text is not None else path.read_text()
    gin.clear_config(clear_constants=True)
    try:
        with gin.unlock_config():
            gin.parse_config(text)
    except Exception as err:  # gin raises ValueError, SyntaxError, ImportError, KeyError...
        message = str(err).strip()
        found = _LINE_RE.search(message)
        where = f"{path}"
        if found:
            lineno = int(found.group(1))
            where = f"{path}:{lineno} (from {origin(text, lineno)})"
        raise ConfigError(f"{where}: {type(err).__name__}: {message}") from err


def run_train(path: str | Path, actions: dict | None = None) -> Any:
    """Parse config.gin and call the bound train_script.train (plus extra actions by mode)."""
    from capibara_exp.runtime import train_script

    parse(path)
    train = gin.get_configurable(train_script.train)
    if not actions:
        return train()
    # Both the gin-bound actions (e.g. a consensus merge) and the caller's (a sweep trial's
    # pruning) run: the bound ones first, in their modes' order.
    bound = gin.get_bindings(train_script.train).get("actions") or {}
    merged = {mode: [*bound.get(mode, []), *actions.get(mode, [])]
              for mode in dict.fromkeys([*bound, *actions])}
    return train(actions=merged)
