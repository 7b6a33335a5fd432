"""Where a cell's code holds text (string literals and comments) rather than code: an
unquoted `password = new_password` in code is a variable, the same line inside a string
(an INI block, a DSN) or a comment is a setting. Shells are not code here: in bash
`TOKEN=abc` assigns the literal text.
"""

from __future__ import annotations

import bisect
import io
import re
import tokenize

# (quote characters, line-comment markers) per language; any other named language but
# the shells is read with the defaults.
_SYNTAX = {
    "javascript": ("'\"`", ("//",)),
    "typescript": ("'\"`", ("//",)),
    "java": ("'\"", ("//",)),
    "sql": ("'\"", ("--",)),
    "r": ("'\"`", ("#",)),
}
_DEFAULT = ("'\"`", ("//", "#"))
_MAGIC = re.compile(r"(?m)^[ \t]*[!%].*$")
SHELLS = frozenset({"bash", "sh", "shell", "zsh", "powershell", "pwsh", "cmd"})


def _python(code: str) -> list[tuple[int, int]]:
    starts = [0]
    for line in code.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                out.append(
                    (starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1])
                )
    except (tokenize.TokenError, SyntaxError, IndexError):
        pass  # code that does not tokenize: the text read so far
    return out


def _scan(code: str, quotes: str, comments: tuple[str, ...]) -> list[tuple[int, int]]:
    out, i, n = [], 0, len(code)
    while i < n:
        ch = code[i]
        if ch in "/#-" and code.startswith(comments, i):
            end = code.find("\n", i)
            end = n if end == -1 else end
            out.append((i, end))
            i = end
        elif code.startswith("/*", i):
            end = code.find("*/", i + 2)
            end = n if end == -1 else end + 2
            out.append((i, end))
            i = end
        elif ch in quotes:
            j = i + 1
            while j < n and code[j] != ch:
                j += 2 if code[j] == "\\" else 1
            out.append((i, min(j + 1, n)))
            i = j + 1
        else:
            i += 1
    return out


def _magics(code: str) -> list[tuple[int, int]]:
    """Lines of a notebook cell run by the shell or IPython (`!cmd`, `%env X=y`)."""
    return [(m.start(), m.end()) for m in _MAGIC.finditer(code)]


def text_spans(code: str, language: str | None) -> list[tuple[int, int]]:
    """Sorted (start, end) of the string literals and comments of `code`."""
    if language == "python":
        spans = _python(code) + _magics(code) if ("!" in code or "%" in code) else _python(code)
        return sorted(spans)
    quotes, comments = _SYNTAX.get(language or "", _DEFAULT)
    return _scan(code, quotes, comments)


def in_code(code: str, language: str | None):
    """A function pos -> whether code[pos] is code (not inside a string or a comment)."""
    if not language or language.lower() in SHELLS:
        return lambda pos: False
    found: list = []  # the spans, read on the first question (most texts never ask)

    def check(pos: int) -> bool:
        if not found:
            spans = text_spans(code, language.lower())
            found.extend([spans, [lo for lo, _ in spans]])
        spans, starts = found
        at = bisect.bisect_right(starts, pos) - 1
        return not (at >= 0 and spans[at][0] <= pos < spans[at][1])

    return check
