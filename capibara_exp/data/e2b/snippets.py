"""Real code no one here wrote, found on this machine, as cells for the sandbox.

- `stdlib_doctests`: the doctest examples of the installed Python standard library, one
  cell per docstring, run in the namespace of its module as doctest runs them.
- `numpy_doctests`: the same for the installed NumPy (numerical/ML code).
- `sqlite_statements`: the SQL that CPython's own sqlite3 tests execute, one cell per test
  method after its class's setUp statements, against a fresh sqlite3 database.
- `markdown_javascript`: the ```js blocks of the READMEs of installed node packages (and
  other Markdown on the machine), run under node.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from capibara_exp.data import corpus

MAX_CODE_CHARS = 4000
# Modules whose import has side effects outside the sandbox's reach or opens windows.
_NO_IMPORT = {
    "antigravity",
    "this",
    "webbrowser",
    "turtle",
    "tkinter",
    "idlelib",
    "pydoc",
    "__main__",
    "__phello__",
    "__hello__",
    "ctypes",
    "multiprocessing",
    "concurrent",
    "asyncio",
    "pdb",
    "bdb",
    "trace",
    "tracemalloc",
    "faulthandler",
    "signal",
    "pty",
    "tty",
    "curses",
    "readline",
    "rlcompleter",
    "getpass",
    "code",
    "codeop",
    "crypt",
    "spwd",
}
_SQL_PARAM = re.compile(r"\?|[:@$][A-Za-z_]")
_JS_FENCE = re.compile(r"^\s*```\s*(js|javascript)\s*\n(.*?)^\s*```", re.M | re.S)
JS_ROOTS = ("/usr/lib/node_modules", "/usr/local/lib/node_modules", "/usr/share/nodejs")


@dataclasses.dataclass(frozen=True)
class Snippet:
    """One cell to execute: code, language, where it came from, and how to set it up."""

    id: str
    language: str
    code: str
    source: str
    expected_output: str | None = None
    module: str | None = None  # run in a copy of this module's globals (doctest semantics)
    setup: str = ""  # run silently before the cell, never part of the record

    def cell(self) -> dict:
        return {
            "id": self.id,
            "code": self.code,
            "reset": True,
            "module": self.module,
            "setup": self.setup,
        }


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of a file's module, classes and functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    stack = [(tree, "")]
    while stack:
        node, prefix = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, f"{prefix}{child.name}."))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and ">>>" in doc:
                yield prefix.rstrip(".") or "<module>", doc


def _doctest_snippets(
    files: list[Path], root: Path, source: str, setup: str = ""
) -> Iterator[Snippet]:
    parser = doctest.DocTestParser()
    for path in files:
        module = _module_name(path, root)
        if _NO_IMPORT.intersection(module.split(".")):
            continue
        for name, doc in _docstrings(path):
            try:
                examples = parser.get_examples(doc)
            except ValueError:
                continue  # a malformed doctest in the docstring itself
            # A cell stops at its first exception where doctest goes on: end the cell with the
            # first example that documents one, so the cell's error is the documented one.
            raising = next((i for i, ex in enumerate(examples) if ex.exc_msg is not None), None)
            examples = examples if raising is None else examples[: raising + 1]
            code = "".join(ex.source for ex in examples)
            if not examples or len(code) > MAX_CODE_CHARS:
                continue
            yield Snippet(
                id=f"{source}:{module}:{name}",
                language="python",
                code=code,
                source=f"{source}:{module}",
                expected_output="".join(ex.want for ex in examples),
                module=module,
                setup=setup,
            )


def stdlib_doctests() -> Iterator[Snippet]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return _doctest_snippets(corpus.stdlib_sources(), root, "stdlib-doctest")


def numpy_doctests() -> Iterator[Snippet]:
    try:
        import numpy
    except ImportError:
        return iter(())
    pkg = Path(numpy.__file__).parent
    files = [
        p
        for p in sorted(pkg.rglob("*.py"))
        if not {"tests", "testing", "_pyinstaller", "f2py", "distutils"}.intersection(p.parts)
    ]
    return _doctest_snippets(files, pkg.parent, "numpy-doctest", setup="import numpy as np")


def _sql_calls(node: ast.AST) -> list[str]:
    """String SQL passed to .execute / .executescript in a function, in source order."""
    out = []
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("execute", "executescript")
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
            and len(call.args) == 1
        ):
            sql = call.args[0].value.strip().rstrip(";")
            if sql and not _SQL_PARAM.search(sql):
                out.append(sql)
    return out


def sqlite_statements() -> Iterator[Snippet]:
    tests = Path(sysconfig.get_paths()["stdlib"]) / "test" / "test_sqlite3"
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
            setup = [s for m in methods if m.name == "setUp" for s in _sql_calls(m)]
            for m in methods:
                body = _sql_calls(m) if m.name.startswith("test") else []
                if not body:
                    continue
                code = ";\n".join(setup + body) + ";"
                if len(code) <= MAX_CODE_CHARS:
                    yield Snippet(
                        id=f"cpython-sqlite3-tests:{path.stem}.{cls.name}.{m.name}",
                        language="sql",
                        code=code,
                        source=f"cpython-sqlite3-tests:{path.stem}",
                    )


def _package(path: Path) -> str:
    """The node package a Markdown file documents: the folder after the last node_modules."""
    parts = path.parts
    at = max((i for i, p in enumerate(parts) if p == "node_modules"), default=-1)
    return parts[at + 1] if at + 1 < len(parts) - 1 else parts[0]


def markdown_javascript(roots: tuple[str, ...] = JS_ROOTS) -> Iterator[Snippet]:
    site = sysconfig.get_paths()["purelib"]
    for root in (*roots, site):
        for path in sorted(Path(root).rglob("*.md")) if Path(root).is_dir() else []:
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            for i, match in enumerate(_JS_FENCE.finditer(text)):
                code = match.group(2).strip()
                if code and len(code) <= MAX_CODE_CHARS:
                    name = path.relative_to(root)
                    yield Snippet(
                        id=f"markdown-js:{name}#{i}",
                        language="javascript",
                        code=code,
                        source=f"markdown-js:{_package(name)}",
                    )
