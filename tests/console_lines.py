"""What a console script prints that is progress, not an answer: its first line (once its
command line checks, before the heavy imports) and phase lines (`what ...`, `what ... 15 s`,
`what: 12.3 s`; capibara_exp/base/phases.py). A refusal found after the
first line is one line of its own after them; the tests count the lines that are not
progress."""

from __future__ import annotations

import re

PROGRESS = re.compile(r"^capibara-exp[\w-]*: (starting( \(engine=\w+\))?( \(a sweep\))? \.\.\.|"
                      r"[^:]+ \.\.\.(.* \d+ s)?|[^:]+: \d+\.\d s)$")


def error_lines(text: str) -> list[str]:
    """The non-blank lines of stderr that are not progress."""
    return [line for line in text.splitlines() if line.strip() and not PROGRESS.match(line)]
