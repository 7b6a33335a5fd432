"""Tables whose header names a credential column: pandas DataFrame printouts (text and
HTML), SQL clients' result grids (psql, mysql, sqlite3, DuckDB's boxes), Markdown and CSV,
and SQL `INSERT ... (columns) VALUES (...)`. A row's cell under a credential column is a
secret by the column's rule (name_cues.py); name/value rows (`api_key | <value>`) are read by
contexts.left_cue, as any name left of a value is.
"""

from __future__ import annotations

import re

from capibara_exp.data.e2b.scrub import contexts, keep, name_cues, shape

_ROWS_MAX = 500
_DELIMITERS = ("│", "|", "\t", ",")
_RULE_LINE = re.compile(r"^[\s\-+=|│─┼┬┴├┤┌┐└┘╞╡═╪:]*$")
_HEADER_CELL = re.compile(r"(?!.*--)[^\W\d][\w.\-%#/]*")  # a name, not an armour line
_TABLE_NAME = r"(?P<table>[\w.\"`\[\]]+)"
_INSERT = re.compile(
    rf"(?is)\binsert\s+(?:or\s+\w+\s+)?into\s+{_TABLE_NAME}\s*(?:\((?P<cols>[^)]*)\)\s*)?values\s*"
    r"(?P<rows>(?:\([^;]*?\)\s*,?\s*)+)"
)
_CREATE = re.compile(
    rf"(?is)\bcreate\s+(?:temp\w*\s+)?table\s+(?:if\s+not\s+exists\s+)?{_TABLE_NAME}\s*\((?P<defs>.*?)\)\s*;"
)
_CONSTRAINT = re.compile(r"(?i)^(?:primary|foreign|unique|check|constraint|key|index)\b")
_SQL_LITERAL = re.compile(r"'(?:[^']|'')*'|[^,()']+")
_NAME_COLUMNS = frozenset(
    "name key setting variable var param parameter field parameterkey".split()
)
_VALUE_COLUMNS = frozenset("value val setting_value parametervalue".split())
_HTML_ROW = re.compile(r"(?is)<tr[^>]*>(.*?)</tr>")
_HTML_CELL = re.compile(r"(?is)<t([hd])[^>]*>(.*?)</t\1>")


def _secret(value: str, column: str) -> bool:
    rule, value = name_cues.rule(column), value.strip().strip("'\"`")
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


def pair_columns(headers: list[str]) -> tuple[int, int] | None:
    """(name, value) column indices of a name/value table (`name | value`, `key, value`)."""
    lowered = [h.strip(" \"'`[]").lower() for h in headers]
    name = next((i for i, h in enumerate(lowered) if h in _NAME_COLUMNS), None)
    value = next((i for i, h in enumerate(lowered) if h in _VALUE_COLUMNS), None)
    return None if name is None or value is None else (name, value)


def _cue_columns(line: str) -> tuple[str | None, list[tuple[int, int, int, str]]]:
    """(delimiter, [(index, start, end, name)]) of the credential columns of a header; a
    name/value header gives its value column with the name `*` (the row names it)."""
    delim = next((d for d in _DELIMITERS if line.count(d) >= 1), None)
    cells = _cells(line, delim)
    named = [c for c in cells if c[2]]
    if len(named) < 2 or not all(_HEADER_CELL.fullmatch(c[2]) for c in named):
        return delim, []
    columns = [
        (i, lo, hi, text)
        for i, (lo, hi, text) in enumerate(cells)
        if name_cues.rule(text) in ("chosen", "generated")
    ]
    pair = pair_columns([c[2] for c in cells])
    if pair is not None:
        lo, hi, _ = cells[pair[1]]
        columns.append((pair[1], lo, hi, f"*{pair[0]}"))
    return delim, columns


def _row_cell(cells, delim, index, lo, hi):
    if delim is not None:
        return cells[index] if index < len(cells) else None
    best = max(cells, key=lambda c: min(c[1], hi) - max(c[0], lo), default=None)
    return best if best and min(best[1], hi) > max(best[0], lo) else None


def _name_span(header: str, delim: str | None, index: int) -> tuple[int, int, int]:
    lo, hi, _ = _cells(header, delim)[index]
    return index, lo, hi


def text_tables(text: str, header_lines: set[int]) -> list[tuple[int, int, str]]:
    """Cells under credential columns of text tables (outputs, not code); the header is
    one of `header_lines` (the lines with a cue word)."""
    out, lines, offsets = [], text.split("\n"), []
    pos = 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    for at in sorted(header_lines):
        header = lines[at]
        delim, columns = _cue_columns(header)
        if not columns:
            continue
        width = len(_cells(header, delim))
        for row_at in range(at + 1, min(len(lines), at + 1 + _ROWS_MAX)):
            row = lines[row_at]
            if not row.strip():
                break
            if _RULE_LINE.fullmatch(row) or (delim is None and contexts.REDACTED in row):
                continue  # a rule line; a row already redacted (its columns have moved)
            cells = _cells(row, delim)
            if delim is not None and len(cells) != width:
                break
            for index, lo, hi, name in columns:
                if name.startswith("*"):  # a name/value row: the row's name cell names it
                    name_cell = _row_cell(cells, delim, *_name_span(header, delim, int(name[1:])))
                    name = name_cell[2] if name_cell else ""
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
        if all(c.group(1).lower() == "h" for c in cells[1:]) and len(cells) > 1:
            columns = {i: h for i, h in heads.items()
                       if name_cues.rule(h) in ("chosen", "generated")}
            pair = pair_columns([heads[i] for i in range(len(cells))])
            if pair is not None:
                columns[pair[1]] = f"*{pair[0]}"
            continue
        for i, name in columns.items():
            if name.startswith("*"):
                at = int(name[1:])
                name = re.sub(r"<[^>]+>", "", cells[at].group(2)) if at < len(cells) else ""
            if i < len(cells) and _secret(cells[i].group(2), name):
                base = row.start(1) + cells[i].start(2)
                out.append((base, base + len(cells[i].group(2)), "table_secret"))
    return out


def _bare(name: str) -> str:
    return name.strip(" \"`'[]\n\t").lower()


def _create_columns(text: str) -> dict[str, list[str]]:
    """Columns of each `CREATE TABLE` in the text (an INSERT without a column list uses them)."""
    out = {}
    for m in _CREATE.finditer(text):
        defs = [d.strip() for d in re.split(r",(?![^()]*\))", m.group("defs"))]
        out[_bare(m.group("table"))] = [
            _bare(d.split()[0]) for d in defs if d and not _CONSTRAINT.match(d)
        ]
    return out


def sql_inserts(text: str) -> list[tuple[int, int, str]]:
    """Values of `INSERT ... VALUES (...), (...)` under credential columns (from the
    statement's column list, or the table's CREATE TABLE in the same text)."""
    out, created = [], None
    for m in _INSERT.finditer(text):
        if m.group("cols") is not None:
            cols = [_bare(c) for c in m.group("cols").split(",")]
        else:
            created = _create_columns(text) if created is None else created
            cols = created.get(_bare(m.group("table")), [])
        for row in re.finditer(r"\(([^()]*)\)", m.group("rows")):
            values = [v for v in _SQL_LITERAL.finditer(row.group(1)) if v.group().strip()]
            if len(values) != len(cols):
                continue
            pair = pair_columns(cols)
            for i, (col, value) in enumerate(zip(cols, values, strict=True)):
                if pair is not None and i == pair[1]:
                    col = values[pair[0]].group().strip().strip("'")
                literal = value.group().strip()
                if literal.startswith("'") and _secret(literal[1:-1], col):
                    start = (
                        m.start("rows") + row.start(1) + value.start() + value.group().index("'")
                    )
                    out.append((start + 1, start + len(literal) - 1, "sql_secret"))
    return out
