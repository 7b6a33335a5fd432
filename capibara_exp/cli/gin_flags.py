"""T5X's --gin.NAME=VALUE flags and `gin_bindings` entries that set a macro the config
knows (TRAIN_STEPS is trainer.train_steps), checked as that key is: a value the YAML path
refuses is refused here too, named as the user wrote it (the flag, or gin_bindings[i]).
A macro no template, config value or gin file defines is an error with a did-you-mean:
gin would take it silently and nothing would read it."""

from __future__ import annotations

import ast
import re

from omegaconf import DictConfig

from capibara_exp.base.errors import ConfigError
from capibara_exp.composing import config_schema, gin_bridge
from capibara_exp.composing.config_check import Composition, did_you_mean

_MACRO = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", re.S)
_DEFINED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=", re.M)
BINDINGS_MARK = "# ===== gin_bindings"


def macro_keys(comp: Composition) -> dict[str, str]:
    """Macro -> the config key whose value it is (the bridge's rule: a gin group's key in
    capitals; model_dir and random_seed at the root)."""
    groups = (*gin_bridge.GIN_GROUPS, *gin_bridge.OPTIONAL_GROUPS)
    out = {key.upper(): key for key in gin_bridge.ROOT_MACROS}
    for key in comp.defaults:
        parts = key.split(".")
        if len(parts) == 2 and parts[0] in groups:
            out.setdefault(parts[1].upper(), key)
    return out


def check(comp: Composition, cfg: DictConfig, text: str, flags: dict[str, str]) -> None:
    """Check each macro binding of cfg.gin_bindings; `text` is the rendered config.gin and
    `flags` maps a binding to the --gin. flag it came from."""
    keys = macro_keys(comp)
    defined = set(_DEFINED.findall(text.split(BINDINGS_MARK)[0]))
    for i, binding in enumerate(list(cfg.get("gin_bindings") or [])):
        where = flags.get(str(binding), f"gin_bindings[{i}]")
        _check_syntax(str(binding), where)
        found = _MACRO.match(str(binding))
        if not found:
            continue  # not NAME = VALUE: the bridge names it
        name, value_text = found.group(1), found.group(2).strip()
        key = keys.get(name)
        if key is None or key.split(".")[0] not in cfg or cfg.get(key.split(".")[0]) is None:
            if name not in defined and name.isupper():
                raise ConfigError(f"{where}: no gin macro {name} in config.gin (gin would "
                                  f"bind it and nothing read it){did_you_mean(name, defined)}")
            continue
        try:
            value = _literal(value_text)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        if value is _NOT_LITERAL:
            continue  # a reference (%MACRO, @name): gin resolves it
        rule = config_schema.rule_for(comp.config_name, key, comp.defaults.get(key))
        problem = rule.problem(value) if rule else None
        if problem:
            raise ConfigError(f"{where} sets {key}={value_text[:80]}: expected {problem}")


_NOT_LITERAL = object()
_BINDING = re.compile(r"^\s*([A-Za-z_][\w./]*)\s*=(.*)$", re.S)


def _check_syntax(binding: str, where: str) -> None:
    """A value gin's own parser cannot read is refused here, before anything heavy loads
    (a reference to a configurable is left to the full check, which imports the modules)."""
    import tokenize

    import gin

    found = _BINDING.match(binding)
    if not found:
        return
    try:
        gin.config.parse_value(found.group(2).strip())
    except (SyntaxError, tokenize.TokenError) as err:
        message = str(err.args[0] if err.args else err).splitlines()[0]
        if message.startswith("malformed node"):  # ast's words for a bare name
            message = "gin takes a Python literal, a %MACRO or an @configurable"
        raise ConfigError(f"{where} ({found.group(1)}): {message}; "
                          f"{found.group(2).strip()[:40]!r} is not a gin value") from None
    except Exception:  # noqa: BLE001 - references and the rest: the full check names them
        return


def _literal(text: str) -> object:
    if "%" in text or "@" in text:
        return _NOT_LITERAL
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as err:
        if "digits" in str(err):
            raise ConfigError(f"{text[:40]}...: an integer of {len(text)} digits") from None
        return _NOT_LITERAL
