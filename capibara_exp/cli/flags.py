"""A console script's command line: Hydra's flags, its overrides, and T5X's gin flags.

T5X users type `--gin_file=F`, `--gin.X=V`, `--gin_bindings=B` and `--gin_search_paths=D`;
capibara-exp takes them with T5X's meaning (applied after the rendered config, in that
order) as the config keys `gin_files`, `gin_bindings` and `gin_search_paths`, to which
they append.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from capibara_exp.base.errors import ConfigError

# Hydra's flags: those taking a value, those taking none, and those that only inform
# (no config is checked for them).
_VALUE_FLAGS = {"--config-path": "-cp", "--config-name": "-cn", "--config-dir": "-cd",
                "--cfg": "-c", "--package": "-p", "--experimental-rerun": None}
_BARE_FLAGS = {"--help": "-h", "--hydra-help": None, "--version": None, "--resolve": None,
               "--run": "-r", "--multirun": "-m", "--shell-completion": "-sc", "--info": "-i"}
_INFORMING = {"--help", "-h", "--hydra-help", "--version", "--shell-completion", "-sc",
              "--info", "-i", "--experimental-rerun"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
_FLAG_NAMES = {*_VALUE_FLAGS, *_BARE_FLAGS, *(v for v in (*_VALUE_FLAGS.values(),
                                                         *_BARE_FLAGS.values()) if v)}
T5X_FLAGS = ("--gin_file", "--gin_bindings", "--gin_search_paths", "--gin.")
_OVERRIDE = re.compile(r"^[+~]{0,2}[\w.@/-]+=\S*$")  # key=value, as Hydra overrides are written


@dataclasses.dataclass
class CommandLine:
    """What the shell needs to know of argv before Hydra reads it."""

    flags: list[str]  # Hydra's flags, with their values, in order
    overrides: list[str]  # everything else: Hydra overrides
    gin_files: list[str] = dataclasses.field(default_factory=list)
    gin_bindings: list[str] = dataclasses.field(default_factory=list)
    gin_search_paths: list[str] = dataclasses.field(default_factory=list)
    gin_flags: dict[str, str] = dataclasses.field(default_factory=dict)  # binding -> its flag

    @property
    def config_dirs(self) -> list[Path]:
        return [Path(v) for i, a in enumerate(self.flags)
                for v in ([self.flags[i + 1]] if a in ("--config-dir", "-cd") else
                          [a.split("=", 1)[1]] if a.startswith("--config-dir=") else [])]

    @property
    def multirun(self) -> bool:
        return any(a in ("--multirun", "-m") for a in self.flags) or any(
            o.replace(" ", "") == "hydra.mode=MULTIRUN" for o in self.overrides)

    @property
    def completing(self) -> bool:
        """--shell-completion: its overrides are Hydra's subcommands, not config keys."""
        return any(a in ("--shell-completion", "-sc") for a in self.flags)

    @property
    def informing(self) -> bool:
        """--help, --info and the like: Hydra answers them without running anything."""
        return any(a.split("=")[0] in _INFORMING for a in self.flags)

    @property
    def shows_config(self) -> bool:
        return any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in self.flags)

    @property
    def has_gin_flags(self) -> bool:
        return bool(self.gin_files or self.gin_bindings or self.gin_search_paths)

    def hydra_argv(self, extra_overrides: list[str] = ()) -> list[str]:
        """Hydra's argv: the overrides first, so that a bare `--info` (its value optional)
        does not take the override after it as its value."""
        return [*self.overrides, *extra_overrides, *self.flags]


def parse(argv: list[str]) -> CommandLine:
    """Split argv; a flag neither Hydra nor T5X has is a ConfigError naming it."""
    line = CommandLine([], [])
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg.startswith(T5X_FLAGS):
            i += _t5x_flag(line, argv, i)
            continue
        if name in _VALUE_FLAGS or name in _VALUE_FLAGS.values():
            takes = 1 if "=" in arg else 2
            if takes == 2 and (i + 1 >= len(argv) or argv[i + 1].split("=")[0] in _FLAG_NAMES):
                raise ConfigError(f"{arg} needs a value")
            line.flags += argv[i:i + takes]
            i += takes
        elif name in _BARE_FLAGS or name in _BARE_FLAGS.values():
            line.flags.append(arg)
            if name in ("--info", "-i") and i + 1 < len(argv) and argv[i + 1] in _INFO_CHOICES:
                line.flags.append(argv[i + 1])
                i += 1
            i += 1
        elif arg.startswith("-") and not arg.startswith(("~", "+")) and "=" not in name:
            raise ConfigError(f"unknown flag {arg}: Hydra's flags are {', '.join(_BARE_FLAGS)}, "
                              f"{', '.join(_VALUE_FLAGS)}; T5X's --gin_file=F, --gin.X=V, "
                              "--gin_bindings=B, --gin_search_paths=D")
        else:
            line.overrides.append(_sized(arg))
            i += 1
    if any(a.split("=")[0] in ("--package", "-p") for a in line.flags) and not line.shows_config:
        raise ConfigError("--package only chooses what --cfg shows (--cfg job --package "
                          "model); without --cfg it does nothing")
    _one_mode(line)
    helping = any(a in ("--help", "-h", "--hydra-help") for a in line.flags)
    if line.completing and not helping:  # (Hydra answers --help first)
        _completion(line)
    for i, flag in enumerate(line.flags):
        name, _, value = flag.partition("=")
        if name == "--experimental-rerun":
            _rerun_file(value or line.flags[i + 1])
    return line


_SHELLS = ("bash", "fish", "zsh")  # Hydra's completion plugins
_SUBCOMMANDS = ("install", "uninstall", "query")


def _completion(line: CommandLine) -> None:
    """Hydra's --shell-completion takes one of install=SHELL, uninstall=SHELL, query=SHELL
    (it raised a ValueError for anything else: an internal error)."""
    given = [o.partition("=") for o in line.overrides]
    subcommands = [(k, v) for k, _, v in given if k in _SUBCOMMANDS]
    usage = (f"--shell-completion takes one of {', '.join(f'{c}=SHELL' for c in _SUBCOMMANDS)} "
             f"(SHELL: {', '.join(_SHELLS)}); `eval` what -sc install=bash prints")
    if len(subcommands) != 1:
        raise ConfigError(usage)
    key, shell = subcommands[0]
    if shell not in _SHELLS:
        raise ConfigError(f"{key}={shell}: no completion for that shell; {usage}")
    if key == "query" and "COMP_LINE" not in os.environ:
        raise ConfigError("query=... is what the installed completion runs (it reads "
                          "$COMP_LINE, unset here); install it with -sc install=SHELL")


def _rerun_file(path: str) -> None:
    """--experimental-rerun reads a run's .hydra/config.pickle: a file that is not a pickle
    of an OmegaConf config is refused here (Hydra's unpickling raised, an internal error).
    The check walks the pickle's opcodes; it runs nothing of the file."""
    import pickletools

    where = f"--experimental-rerun {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{where}: {err.strerror or err}") from None
    try:
        names = [str(arg) for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    except Exception:  # noqa: BLE001 - any malformation: not a pickle
        names = None
    if not names or not any(n.startswith("omegaconf") for n in names):
        raise ConfigError(f"{where}: not a Hydra job's config.pickle (a run's "
                          ".hydra/config.pickle)")


# Hydra's modes: it runs one of them per command (and refuses two with a ValueError)
_MODES = {"--run": "--run", "-r": "--run", "--multirun": "--multirun", "-m": "--multirun",
          "--cfg": "--cfg", "-c": "--cfg", "--info": "--info", "-i": "--info",
          "--shell-completion": "--shell-completion", "-sc": "--shell-completion"}


def _one_mode(line: CommandLine) -> None:
    """Hydra's order: --help answers whatever else is there; --resolve needs --cfg; then
    --hydra-help answers; then at most one mode."""
    names = [a.split("=")[0] for a in line.flags]
    if "--help" in names or "-h" in names:
        return
    if "--resolve" in names and not line.shows_config:
        raise ConfigError("--resolve only changes what --cfg or --help shows (--cfg job "
                          "--resolve)")
    modes = list(dict.fromkeys(_MODES[n] for n in names if n in _MODES))
    if len(modes) > 1 and "--hydra-help" not in names:
        raise ConfigError(f"{' and '.join(modes)} together: a command runs one of --run, "
                          "--multirun, --cfg, --info, --shell-completion")


_LONG_NUMBER = re.compile(r"[-+]?\d{1000,}")
MAX_KEY = 255


def _sized(arg: str) -> str:
    """An override whose key or number is beyond what any config holds, named before Hydra
    tries it (a key becomes a file name; Python refuses integers over 4,300 digits)."""
    key, _, value = arg.partition("=")
    if len(key) > MAX_KEY:
        raise ConfigError(f"an override key of {len(key)} characters ({key[:40]}...): no key "
                          f"of the config is longer than {MAX_KEY}")
    if _LONG_NUMBER.fullmatch(value.strip()):
        raise ConfigError(f"{key}: an integer of {len(value.strip())} digits; no key takes "
                          "a number that size")
    return arg


def _t5x_flag(line: CommandLine, argv: list[str], i: int) -> int:
    """Take one T5X flag at argv[i] into `line`; how many arguments it used."""
    arg = argv[i]
    if arg.startswith("--gin."):
        name, eq, value = arg[len("--gin."):].partition("=")
        if not eq or not name or not value.strip():
            raise ConfigError(f"{arg}: T5X's --gin.NAME=VALUE binds NAME = VALUE (a string "
                              "needs inner quotes: --gin.MODEL_DIR=\"'/tmp/run'\")")
        line.gin_bindings.append(f"{name} = {value}")
        line.gin_flags[f"{name} = {value}"] = arg
        return 1
    name, eq, value = arg.partition("=")
    used = 1
    if not eq:  # `--gin_file F`: the next argument, unless it is a flag or a Hydra override
        if i + 1 >= len(argv) or argv[i + 1].startswith("-") or _OVERRIDE.match(argv[i + 1]):
            raise ConfigError(f"{name} needs a value ({name}=...)")
        value, used = argv[i + 1], 2
    if name == "--gin_file":
        line.gin_files.append(value)
    elif name == "--gin_bindings":
        line.gin_bindings.extend(b for b in value.splitlines() if b.strip())
    elif name == "--gin_search_paths":
        line.gin_search_paths.extend(p for p in value.split(",") if p)
    else:
        raise ConfigError(f"unknown flag {name}: T5X's gin flags are --gin_file, --gin.NAME, "
                          "--gin_bindings, --gin_search_paths")
    if not value.strip():
        raise ConfigError(f"{name} needs a value ({name}=...)")
    return used
