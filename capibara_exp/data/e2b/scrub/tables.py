"""Tables whose header names a credential column: pandas DataFrame printouts (text and
HTML), SQL clients' result grids (psql, mysql, sqlite3, DuckDB's boxes), Markdown and CSV,
and SQL `INSERT ... (columns) VALUES (...)`. A row's cell under a credential column is a
secret by the column's rule (names.py); name/value rows (`api_key | <value>`) are read by
contexts.left_cue, as any name left of a value is.
"""

from __future__ import annotations

import re

from capibara_exp.data.e2b.scrub import keep, names, shape

_ROWS_MAX = 500
_DELIMITERS = ("│", "|", "\t", ",")
_RULE_LINE = re.compile(r"^[\s\-+=|│─┼┬┴├┤┌┐└┘╞╡═╪:]*$")
_HEADER_CELL = re.compile(r"[\w.\-%#/]+")
_INSERT = re.compile(
    r"(?is)\binsert\s+(?:or\s+\w+\s+)?into\s+[\w.\"`\[\]]+\s*\((?P<cols>[^)]*)\)\s*values\s*"
    r"(?P<rows>(?:\([^;]*?\)\s*,?\s*)+)"
)
_SQL_LITERAL = re.compile(r"'(?:[^']|'')*'|[^,()']+")
_HTML_ROW = re.compile(r"(?is)<tr[^>]*>(.*?)</tr>")
_HTML_CELL = re.compile(r"(?is)<t([hd])[^>]*>(.*?)</t\1>")


def _secret(value: str, column: str) -> bool:
    rule, value = names.rule(column), value.strip().strip("'\"`")
    if rule not in ("chosen", "generated") or keep.not_a_secret(value, column):
        return False
    if re.search(r"[()\[\]{}]", value):
        return False  # code, not a cell
    return rule == "chosen" or shape.generated(value)


def _cells(line: str, delim: str | None) -> list[tuple[int, int, str]]:
    if delim is None:
        return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", line)]
    out, start = [], 0
    for piece in line.split(delim):
        stripped = piece.strip()
        lead = len(piece) - len(piece.lstrip())
        out.append((start + lead, start + lead + len(stripped), stripped))
        start += len(piece) + len(delim)
    return out


def _cue_columns(line: str) -> tuple[str | None, list[tuple[int, int, int, str]]]:
    """(delimiter, [(index, start, end, name)]) of the credential columns of a header."""
    delim = next((d for d in _DELIMITERS if line.count(d) >= 1), None)
    cells = _cells(line, delim)
    named = [c for c in cells if c[2]]
    if len(named) < 2 or not all(_HEADER_CELL.fullmatch(c[2]) for c in named):
        return delim, []
    return delim, [
        (i, lo, hi, text)
        for i, (lo, hi, text) in enumerate(cells)
        if names.rule(text) in ("chosen", "generated")
    ]


def _row_cell(cells, delim, index, lo, hi):
    if delim is not None:
        return cells[index] if index < len(cells) else None
    best = max(cells, key=lambda c: min(c[1], hi) - max(c[0], lo), default=None)
    return best if best and min(best[1], hi) > max(best[0], lo) else None


def text_tables(text: str) -> list[tuple[int, int, str]]:
    """Cells under credential columns of text tables (outputs, not code)."""
    out, lines, offsets = [], text.split("\n"), []
    pos = 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    for at, header in enumerate(lines):
        delim, columns = _cue_columns(header)
        if not columns:
            continue
        width = len(_cells(header, delim))
        for row_at in range(at + 1, min(len(lines), at + 1 + _ROWS_MAX)):
            row = lines[row_at]
            if not row.strip():
                break
            if _RULE_LINE.fullmatch(row):
                continue
            cells = _cells(row, delim)
            if delim is not None and len(cells) != width:
                break
            for index, lo, hi, name in columns:
                cell = _row_cell(cells, delim, index, lo, hi)
                if cell and cell[2] and _secret(cell[2], name):
                    base = offsets[row_at]
                    out.append((base + cell[0], base + cell[1], "table_secret"))
    return out


def html_tables(text: str) -> list[tuple[int, int, str]]:
    out, columns = [], {}
    for row in _HTML_ROW.finditer(text):
        cells = list(_HTML_CELL.finditer(row.group(1)))
        heads = {i: re.sub(r"<[^>]+>", "", c.group(2)).strip() for i, c in enumerate(cells)}
        if all(c.group(1) == "th" for c in cells[1:]) and len(cells) > 1:
            columns = {i: h for i, h in heads.items() if names.rule(h) in ("chosen", "generated")}
            continue
        for i, name in columns.items():
            if i < len(cells) and _secret(cells[i].group(2), name):
                base = row.start(1) + cells[i].start(2)
                out.append((base, base + len(cells[i].group(2)), "table_secret"))
    return out


def sql_inserts(text: str) -> list[tuple[int, int, str]]:
    """Values of `INSERT ... (cols) VALUES (...), (...)` under credential columns."""
    out = []
    for m in _INSERT.finditer(text):
        cols = [c.strip(" \"`'[]\n") for c in m.group("cols").split(",")]
        for row in re.finditer(r"\(([^()]*)\)", m.group("rows")):
            values = [v for v in _SQL_LITERAL.finditer(row.group(1)) if v.group().strip()]
            if len(values) != len(cols):
                continue
            for col, value in zip(cols, values, strict=True):
                literal = value.group().strip()
                if literal.startswith("'") and _secret(literal[1:-1], col):
                    start = m.start("rows") + row.start(1) + value.start() + value.group().index("'")
                    out.append((start + 1, start + len(literal) - 1, "sql_secret"))
    return out
