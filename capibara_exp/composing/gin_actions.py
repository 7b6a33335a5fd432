"""One `train_script.train.actions` binding for config.gin: the project's actions and the
user's, joined by mode.

gin keeps only the last binding of a parameter, so a user's `train_script.train.actions =
{...}` (in a --gin_file or gin_bindings, T5X's documented way to add a callback) would
replace the project's own (checksums, early stopping, a consensus merge). Instead, every
action is named and listed once, at the end of the body: the templates' `<MODE>_ACTION_
<NAME> = @...` macros, the same macros in the user's gin files, and the entries of the
user's last `train_script.train.actions` binding, which the joined binding then
overrides. A note in config.gin (and on the console) says which project actions the
user's binding alone would have dropped. Pure text in, text out, like the bridge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from capibara_exp.base.errors import ConfigError

# gin's parser loads only for a user's gin text that binds actions: `--cfg job` and a run
# without one never import gin before the run's own check of config.gin

MODES = ("TRAIN", "TRAIN_EVAL", "INFER_EVAL")  # T5X's action modes
ACTION_MACRO_RE = re.compile(r"^\s*((TRAIN_EVAL|TRAIN|INFER_EVAL)_ACTION_[A-Z0-9_]+)\s*=", re.M)
NOTE = "# note (actions): "
_ACTIONS_RE = re.compile(r"\bactions\s*=")  # config.gin lines the console repeats (notes())


def _text_delegate() -> object:
    """A gin parser delegate that gives references and macros back as their gin text."""
    from gin import config_parser

    class TextDelegate(config_parser.ParserDelegate):
        def configurable_reference(self, scoped_name: str, evaluate: bool) -> str:
            return f"@{scoped_name}{'()' if evaluate else ''}"

        def macro(self, name: str) -> str:
            return f"%{name}"

    return TextDelegate()


def template_actions(text: str) -> dict[str, list[str]]:
    """{mode: [%MACRO, ...]} of the `<MODE>_ACTION_<NAME> = ...` macros a text binds."""
    by_mode: dict[str, list[str]] = {}
    for macro, mode in ACTION_MACRO_RE.findall(text):
        if f"%{macro}" not in by_mode.get(mode, []):
            by_mode.setdefault(mode, []).append(f"%{macro}")
    return by_mode


def user_actions(text: str, where: str) -> dict[str, list[str]] | None:
    """The entries of the last `train_script.train.actions` binding in a user's gin text
    ({mode: [gin text of each action]}), or None when it binds none. A text gin cannot
    parse, or a binding with a mode that is not T5X's, is left as it is to the check that
    parses config.gin and starts the run, which names the line."""
    if not _ACTIONS_RE.search(text):
        return None
    from gin import config_parser

    found = None
    try:
        for statement in config_parser.ConfigParser(text, _text_delegate()):
            if isinstance(statement, config_parser.BindingStatement) and \
                    _is_train_script(statement):
                found = statement
    except Exception:  # tokenize and gin raise several types for a typo
        return None
    if found is None:
        return None
    value = found.value
    if not isinstance(value, dict) or not all(isinstance(v, (list, tuple))
                                              for v in value.values()):
        raise ConfigError(f"{where}: train_script.train.actions must be a dict of T5X's modes "
                          f"({', '.join(MODES)}) to lists of actions, got {value!r}")
    if set(value) - set(MODES):  # left as the last binding: the engine names the mode
        return None
    return {str(mode): [str(a) for a in acts] for mode, acts in value.items()}


def _is_train_script(statement: object) -> bool:  # gin's BindingStatement
    full = f"{statement.selector}.{statement.arg_name}" if statement.arg_name else \
        statement.selector
    return full == "train_script.train.actions" and not statement.scope


def join(project: dict[str, list[str]], user_macros: dict[str, list[str]],
         user_binding: tuple[str, dict[str, list[str]]] | None) -> list[str]:
    """The joined binding (and its notes) for the end of config.gin; [] when no action."""
    by_mode: dict[str, list[str]] = {}
    sources = [project, user_macros] + ([user_binding[1]] if user_binding else [])
    for source in sources:
        for mode, refs in source.items():
            for ref in refs:
                if ref not in by_mode.setdefault(mode, []):
                    by_mode[mode].append(ref)
    if not by_mode:
        return []
    lines = ["# ===== actions, joined by mode (T5X's modes): the templates', then the user's"]
    if user_binding:
        where, given = user_binding
        dropped = [f"{mode}: {ref}" for mode, refs in project.items() for ref in refs
                   if ref not in given.get(mode, [])]
        if dropped:
            lines.append(f"{NOTE}{where} binds train_script.train.actions; joined with the "
                         f"project's actions instead of replacing them (alone it would have "
                         f"dropped {', '.join(dropped)}; to drop one, leave out the config "
                         "group that adds it)")
    modes = ", ".join(f"'{mode}': [{', '.join(refs)}]" for mode, refs in by_mode.items())
    return [*lines, f"train_script.train.actions = {{{modes}}}"]


def notes(gin_text: str) -> list[str]:
    """The notes about actions in a rendered config.gin (for the console)."""
    return [line[len(NOTE):] for line in gin_text.splitlines() if line.startswith(NOTE)]


def last_user_binding(texts: Sequence[tuple[str, str]]) -> tuple[str, dict] | None:
    """(where, entries) of the last actions binding among the user's gin texts, in order."""
    found = None
    for where, text in texts:
        entries = user_actions(text, where)
        if entries is not None:
            found = (where, entries)
    return found
