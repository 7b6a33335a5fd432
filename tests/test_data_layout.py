"""The data package's layout: the imports that must never exist, checked with `ast`.

capibara_exp/data/e2b/ is the offline pipeline (collect, parse, scrub, build); the modules
beside it (tasks, routing_tasks, packing, corpus, routing) are what training reads. The
offline side never imports SeqIO, TensorFlow, JAX or the training side (only the plain
modules both share: corpus's file helpers, routing's domains); the training side
reaches the offline pipeline through `e2b.built` alone (to read the manifest; it never
builds); nothing else in the project imports the offline pipeline but its console script,
the experiment's data preparation (the build's two triggers) and the code-generation side.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "capibara_exp"
E2B = PACKAGE / "data" / "e2b"
TRAINING_SIDE = ("tasks", "routing_tasks", "routing_difficulty", "packing", "corpus", "routing")
HEAVY = ("seqio", "tensorflow", "jax", "flax", "optax", "orbax")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (`from a import b` gives a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _violations(files, rule) -> list[str]:
    return [f"{_module(f)} imports {m}" for f in files for m in sorted(imports(f)) if rule(m)]


def test_the_offline_pipeline_never_imports_the_training_side_or_its_stack() -> None:
    # corpus and routing are plain modules both sides share (file writes, domain names)
    training = tuple(f"capibara_exp.data.{m}" for m in ("tasks", "routing_tasks", "packing"))
    training += ("capibara_exp.runtime", "capibara_exp.nets", "capibara_exp.composing.gin_bridge")
    files = sorted(E2B.rglob("*.py")) + [
        PACKAGE / "data" / "corpus.py",
        PACKAGE / "data" / "routing.py",
    ]
    assert len(files) > 10

    def forbidden(m: str) -> bool:
        return m.split(".")[0] in HEAVY or any(m == t or m.startswith(t + ".") for t in training)

    bad = _violations(files, forbidden)
    assert not bad, bad


def test_the_training_side_reaches_the_offline_pipeline_only_through_built() -> None:
    files = [PACKAGE / "data" / f"{m}.py" for m in TRAINING_SIDE]
    bad = _violations(
        files,
        lambda m: (
            m.startswith("capibara_exp.data.e2b")
            and m not in ("capibara_exp.data.e2b", "capibara_exp.data.e2b.built")
        ),
    )
    assert not bad, bad


def test_only_the_data_command_and_data_preparation_import_the_offline_pipeline() -> None:
    allowed = {PACKAGE / "cli" / "data.py", PACKAGE / "experiment.py",
               # execution scoring runs generated programs in the E2B sandbox (its limits and
               # minimal environment), and the code-generation task reads the built E2B
               # records (e2b.built: never building them)
               PACKAGE / "generation" / "execution.py", PACKAGE / "generation" / "codegen_task.py"}
    files = [
        f
        for f in sorted(PACKAGE.rglob("*.py"))
        if f not in allowed and PACKAGE / "data" not in f.parents
    ]
    bad = _violations(files, lambda m: m.startswith("capibara_exp.data.e2b"))
    assert not bad, bad


def test_the_sandbox_runners_import_nothing_of_the_project() -> None:
    # they run in a subprocess with a minimal environment, outside the package
    files = sorted((E2B / "runners").glob("*.py"))
    assert files
    assert not _violations(files, lambda m: m.startswith("capibara_exp")), files
