"""A small English text corpus built from the docstrings of the installed Python stdlib.

Real prose that no one here wrote, present on every machine, no download. Built once
into `<data_dir>/bytes_lm/` with a manifest; the split is a hash of each line, so it is
deterministic for a given Python version. Its build has the E2B data's two doors:
`capibara-exp-data` and a run's data preparation (experiment.prepare_data); the task that
reads it (data/tasks.py, TASK) only reads, through `manifest`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path

from capibara_exp.base import atomic
from capibara_exp.data.e2b import built

CORPUS_NAME = "bytes_lm"  # also its name in capibara-exp-data's `datasets`
TASK = "capibara_bytes_lm"  # the SeqIO task reading it (and TASK_<vocabulary tag> variants)
MANIFEST = "manifest.json"  # written last: a corpus without it is not built
VALIDATION_PERCENT = 5
MAX_LINE_CHARS = 480
MIN_LINE_CHARS = 40
# Packages of the stdlib whose docstrings are mostly prose (not tests, not vendored code).
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "turtledemo",
              "tkinter", "pydoc_data", "__pycache__", "encodings"}


def corpus_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / CORPUS_NAME


@functools.cache
def stdlib_sources() -> tuple[Path, ...]:
    """The stdlib's own modules (no tests, no vendored code), sorted; cached per process."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        files.append(path)
    return tuple(files)


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
    return out


def _lines(doc: str) -> list[str]:
    """Split a docstring into paragraphs of prose, each cut at sentence ends to a max length."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        if para.lstrip().startswith((">>>", "...")) or "::" in para:
            continue  # code examples and literal blocks
        text = " ".join(para.split())
        while len(text) > MAX_LINE_CHARS:
            cut = text.rfind(". ", 0, MAX_LINE_CHARS)
            cut = cut + 1 if cut > MIN_LINE_CHARS else text.rfind(" ", 0, MAX_LINE_CHARS)
            if cut <= 0:
                cut = MAX_LINE_CHARS
            out.append(text[:cut].strip())
            text = text[cut:].strip()
        out.append(text)
    return [t for t in out if len(t) >= MIN_LINE_CHARS]


def _is_validation(line: str) -> bool:
    return int(hashlib.sha256(line.encode()).hexdigest()[:8], 16) % 100 < VALIDATION_PERCENT


def reads_corpus(task: str | None) -> bool:
    """Whether the task or mixture named `task` is the one that reads this corpus."""
    return bool(task) and (task == TASK or task.startswith(f"{TASK}_"))


def manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of the corpus built under `data_dir`, never building: NotBuilt naming
    the command that builds it when there is none."""
    return built.read_manifest(corpus_dir(data_dir) / MANIFEST, "text corpus", data_dir,
                               f"'datasets=[{CORPUS_NAME}]'")


def build_corpus(data_dir: str | os.PathLike, force: bool = False) -> dict:
    """Build train.txt / validation.txt once (again with `force`); return the manifest."""
    out_dir = corpus_dir(data_dir)
    manifest_path = out_dir / MANIFEST
    if manifest_path.exists() and not force:
        return json.loads(manifest_path.read_text())
    if force:  # a rebuild: not built until its manifest is back
        manifest_path.unlink(missing_ok=True)
    from capibara_exp.base import phases

    with phases.phase(f"building the text corpus under {out_dir} (first use only)") as shown:
        sources = stdlib_sources()
        splits = _read_splits(sources, shown)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"source": "docstrings of the Python stdlib at " + sysconfig.get_paths()["stdlib"],
                "files_read": len(sources), "splits": {}}
    for split, lines in splits.items():
        payload = ("\n".join(lines) + "\n").encode()
        atomic.write_bytes(out_dir / f"{split}.txt", payload)
        manifest["splits"][split] = {"lines": len(lines), "bytes": len(payload),
                                     "sha256": hashlib.sha256(payload).hexdigest()}
    atomic.write_bytes(manifest_path, json.dumps(manifest, indent=2).encode())
    return manifest


def _read_splits(sources: tuple[Path, ...], shown: object) -> dict[str, list[str]]:
    """The corpus' lines by split, from each file's docstrings (progress on `shown`)."""
    seen: set[str] = set()
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for i, path in enumerate(sources):
        shown.detail = f"{i}/{len(sources)} files read"
        for doc in _docstrings(path.read_text(encoding="utf-8", errors="replace")):
            for line in _lines(doc):
                if line in seen:
                    continue
                seen.add(line)
                splits["validation" if _is_validation(line) else "train"].append(line)
    return splits


def summary(manifest: dict, data_dir: str | os.PathLike) -> dict:
    """What `capibara-exp-data` prints about the corpus: its manifest and lines per split."""
    return {"manifest": str(corpus_dir(data_dir) / MANIFEST),
            "lines": {split: v["lines"] for split, v in manifest["splits"].items()}}
