"""The imports that must never exist (docs/architecture.md), read with the standard library's
`ast` from every module of the package, lazy imports inside functions included. A rule here
is the drawing's: change both together."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "capibara_exp"
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "tensorflow", "seqio", "t5x", "qwix")

# Every module of the package but runtime/stopping.py (and the packages above it, whose
# __init__ files import nothing).
_ALL_BUT_STOPS = tuple(sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts[:-1] if p.name == "__init__.py"
             else p.relative_to(ROOT).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.relative_to(PACKAGE).as_posix() not in ("__init__.py", "runtime/__init__.py",
                                                 "runtime/stopping.py")))

# The floors above the ground (base/): what base/ never imports; compose time (composing/)
# sits on base/ and never imports the rest either.
ABOVE_BASE = ("capibara_exp.composing", "capibara_exp.data", "capibara_exp.nets",
              "capibara_exp.runtime", "capibara_exp.generation", "capibara_exp.convert",
              "capibara_exp.sweeping", "capibara_exp.tuning", "capibara_exp.consensus",
              "capibara_exp.launch", "capibara_exp.experiment", "capibara_exp.cli")
# The leaves of base/ that need no heavy library (environment, phases and the wrappers of
# Optuna and of private APIs are the ones that load or name one).
PURE_LEAVES = tuple(f"capibara_exp.base.{m}" for m in (
    "errors", "paths", "topologies", "meshes", "overrides", "model_facts", "logical_axes",
    "atomic", "metrics_file", "run_lock"))

# (the modules a rule covers, the imports they must never make, why)
NEVER: list[tuple[str | tuple[str, ...], tuple[str, ...], str]] = [
    ("capibara_exp.base", ABOVE_BASE, "the ground floor: every layer stands on it"),
    (PURE_LEAVES, HEAVY, "plain facts and files: no heavy library"),
    ("capibara_exp.composing", (*HEAVY, *ABOVE_BASE[1:], "hydra"),
     "compose time is pure (conf -> checked config -> gin text): a bad key fails before any "
     "heavy import, and the bridge never runs what it names"),
    ("capibara_exp.convert", ("capibara_exp.cli", "capibara_exp.sweeping", "capibara_exp.tuning",
                              "capibara_exp.consensus", "capibara_exp.launch",
                              "capibara_exp.experiment"),
     "models in and out read and write checkpoints (runtime), nothing above"),
    ("capibara_exp.nets", ("capibara_exp.runtime", "capibara_exp.data", "capibara_exp.tuning",
                           "capibara_exp.sweeping", "capibara_exp.consensus", "capibara_exp.cli",
                           "capibara_exp.launch", "capibara_exp.experiment", "gin", "seqio"),
     "networks are Flax modules: no training, data or config machinery"),
    ("capibara_exp.data", ("capibara_exp.runtime", "capibara_exp.nets", "capibara_exp.tuning",
                           "capibara_exp.sweeping", "capibara_exp.consensus", "capibara_exp.cli",
                           "capibara_exp.launch", "capibara_exp.experiment"),
     "data feeds the runtime, never the other way"),
    ("capibara_exp.data.e2b", ("jax", "flax", "optax", "orbax", "t5x", "gin"),
     "the offline E2B pipeline runs without the training stack"),
    ("capibara_exp.runtime", ("capibara_exp.cli", "capibara_exp.experiment",
                              "capibara_exp.sweeping", "capibara_exp.tuning",
                              "capibara_exp.consensus", "capibara_exp.launch",
                              "capibara_exp.generation", "hydra"),
     "the local engine is T5X's train contract: gin in, checkpoints out (decoding too: its "
     "inference eval); callers sit above"),
    ("capibara_exp.tuning", ("capibara_exp.sweeping", "capibara_exp.cli",
                             "capibara_exp.consensus", "capibara_exp.experiment",
                             "capibara_exp.convert"),
     "the planner shares Optuna through optuna_study, not the sweeper"),
    ("capibara_exp.sweeping", ("capibara_exp.tuning", "capibara_exp.cli",
                               "capibara_exp.consensus", "capibara_exp.convert"),
     "sweeps and plans are siblings"),
    ("capibara_exp.consensus", ("capibara_exp.cli", "capibara_exp.sweeping",
                                "capibara_exp.tuning", "capibara_exp.experiment",
                                "capibara_exp.convert"),
     "merging reads runs through their gin bindings (runtime), nothing above (meta-consensus "
     "trains runs through a function its console script hands it)"),
    ("capibara_exp.launch", ("capibara_exp.cli", "capibara_exp.sweeping", "capibara_exp.tuning",
                             "capibara_exp.consensus", "capibara_exp.convert"),
     "launching runs a config.gin"),
    ("capibara_exp.generation", ("capibara_exp.cli", "capibara_exp.sweeping",
                                 "capibara_exp.tuning", "capibara_exp.consensus",
                                 "capibara_exp.launch", "capibara_exp.experiment", "hydra"),
     "decoding and scoring: checkpoints and prompts in, tokens and scores out; callers above"),
    ("capibara_exp.runtime.decoding", _ALL_BUT_STOPS,
     "T5X's decoding around any network: the runtime's inference eval imports it, so it "
     "imports nothing of the project but its stops (runtime/stopping.py, a leaf)"),
    ("capibara_exp.runtime.stopping", ("capibara_exp",),
     "a leaf: where a decoded row ends, for T5X's decoding loop"),
    ("capibara_exp.generation.execution", HEAVY, "programs run without the training stack"),
    ("capibara_exp.kernels", (*ABOVE_BASE, "capibara_exp.base", *HEAVY),
     "Cython kernels and their NumPy references: arrays in, arrays out, for any layer"),
    ("capibara_exp", ("tests", "bench"), "the package never imports its tests or benchmarks"),
]
# Only the console scripts (and the sweeper's Hydra plugin, which is one) import cli/.
CLI_IMPORTERS = ("capibara_exp.cli", "hydra_plugins")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


def within(name: str, prefix: str | tuple[str, ...]) -> bool:
    if not isinstance(prefix, str):
        return any(within(name, p) for p in prefix)
    return name == prefix or name.startswith(prefix + ".")


SOURCES = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])


def test_the_never_imports_do_not_exist() -> None:
    broken = []
    for path in SOURCES:
        name = module_name(path)
        for line, target in imports(path):
            for covered, forbidden, why in NEVER:
                if within(name, covered) and any(within(target, f) for f in forbidden):
                    broken.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                                  f"({covered} never does: {why})")
            if within(target, "capibara_exp.cli") and \
                    not any(within(name, c) for c in CLI_IMPORTERS):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target} (only the "
                              "console scripts import cli/)")
    assert not broken, "\n".join(broken)


def test_the_rules_read_real_imports() -> None:
    """The reader sees lazy, relative and from-imports: a rule that could never fire would
    pass silently, so each kind is checked on the tree as it is."""
    found = {t for p in SOURCES for _, t in imports(p)}
    assert "capibara_exp.composing.merge_methods" in found  # lazy, inside config_schema functions
    assert "capibara_exp.cli.common.checked_argv" in found  # from-import of a name
    assert all(not t.startswith(".") for t in found)  # relative imports made absolute
    for covered, _, _ in NEVER:
        assert any(within(module_name(p), covered) for p in SOURCES), covered


@pytest.mark.parametrize("folder", ["bench", "tests"])
def test_no_script_shadows_the_standard_library(folder: str) -> None:
    """`python bench/x.py` puts bench/ first on sys.path: a bench/secrets.py there broke
    NumPy's import (numpy.random imports `secrets`) in every other bench script."""
    clash = sorted(p.name for p in (ROOT / folder).glob("*.py")
                   if p.stem in sys.stdlib_module_names)
    assert not clash, f"{folder}/ has scripts named like standard modules: {clash}"


def test_modules_and_functions_stay_small() -> None:
    """docs/design.md (style): modules <= 400 lines, functions <= 60."""
    big = []
    for path in SOURCES:
        text = path.read_text()
        if text.count("\n") > 400:
            big.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                               f"{length} lines")
    assert not big, big
