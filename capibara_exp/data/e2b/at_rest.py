"""The last pass before a build's manifest: the full detector over every file the build
wrote (examples, sources, routing data, playbooks, quarantine, collected logs).

Each string was scrubbed where it was read; this pass reads what was written, where one
field's text stands beside another's (a routing example renders code, output and error
together), and redacts in place whatever is found. The manifest counts what it found per
file: zero is what a build should show.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from capibara_exp.base import atomic
from capibara_exp.data.e2b import scrub

# The header and sections routing.render_execution writes: the code is read as code.
_RENDERED = re.compile(
    r"\A(<domain:[^\n]*<language:(?P<lang>[^>\n]+)>\n### code\n)(?P<code>.*?)(?=\n### |\Z)", re.S
)


def _code_paths(obj) -> dict[tuple, str]:
    """Where a row holds code, and in which language: an example's code, a playbook's
    code snippets (read with the syntax common to most languages)."""
    if not isinstance(obj, dict):
        return {}
    paths = {}
    if isinstance(obj.get("code"), str):
        language = obj.get("language")
        paths[("code",)] = language if isinstance(language, str) else None
    for i, entry in enumerate(obj.get("entries") or []):
        if isinstance(entry, dict) and entry.get("section") == "code_snippets":
            paths[("entries", i, "content")] = "code"
    return paths


def _scrub_rendered(text: str) -> tuple[str, Counter]:
    """A routing example's text: its code section as code, the rest as text."""
    m = _RENDERED.match(text)
    if m is None:
        scrubbed, counts = scrub.scrub_text(text)
        return scrubbed, Counter(counts)
    code, n_code = scrub.scrub_text(m.group("code"), m.group("lang"))
    rest, n_rest = scrub.scrub_text(text[m.end() :])
    return m.group(1) + code + rest, Counter(n_code) + Counter(n_rest)


def _scrub_row(obj) -> tuple[object, Counter]:
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        text, found = _scrub_rendered(obj["text"])
        rest, counts = scrub.scrub_tree(
            {k: v for k, v in obj.items() if k != "text"}, _code_paths(obj)
        )
        return {k: text if k == "text" else rest[k] for k in obj}, found + Counter(counts)
    new, counts = scrub.scrub_tree(obj, _code_paths(obj))
    return new, Counter(counts)


def scrub_file(path: Path) -> Counter:
    """Redact secrets in one written file in place (JSONL line by line); what was found."""
    found: Counter = Counter()
    data = path.read_bytes()
    if path.suffix == ".jsonl":
        lines = []
        for line in data.decode("utf-8").split("\n"):
            if not line.strip():
                lines.append(line)
                continue
            obj, counts = _scrub_row(json.loads(line))
            found.update(counts)
            lines.append(json.dumps(obj, ensure_ascii=False) if counts else line)
        out = "\n".join(lines).encode()
    else:
        text, counts = scrub.scrub_text(data.decode("utf-8", "replace"))
        found.update(counts)
        out = text.encode()
    if found:
        atomic.write_bytes(path, out)
    return found


def final_pass(root: Path, files: list[Path]) -> dict[str, dict[str, int]]:
    """{file relative to root: {kind: count}} of what the last pass redacted."""
    out = {}
    for path in files:
        found = scrub_file(path)
        if found:
            out[str(path.relative_to(root))] = dict(sorted(found.items()))
    return out
