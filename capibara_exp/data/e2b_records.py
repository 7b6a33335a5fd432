"""E2B Code Interpreter execution records as JSONL, on the package's own models.

One line is one executed cell: `code`, `language`, and `execution` in the shape of
`e2b_code_interpreter.models.Execution` (results, logs.stdout/stderr as lists of lines,
error name/value/traceback, execution_count), plus the timing and sandbox metadata the
SDK reports around it. `parse_records` turns a file into `ExecutionRecord`s and sends
each malformed line to the quarantine with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

from e2b_code_interpreter.models import Execution, ExecutionError, Logs, Result

from capibara_exp.data.quarantine import (
    MISSING_FIELD,
    OUT_OF_RANGE,
    WRONG_TYPE,
    Quarantine,
    read_json_lines,
)

LANGUAGES = ("python", "sql", "javascript")
# Result formats kept in the log, with their types in E2B's `Result` (images and charts
# are not training text and are dropped).
_RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "html": (str,),
    "markdown": (str,),
    "latex": (str,),
    "json": (dict,),
    "javascript": (str,),
    "data": (dict,),
    "extra": (dict,),
}


@dataclasses.dataclass
class ExecutionRecord:
    """One executed cell: the code, E2B's Execution, timing and where it ran."""

    id: str
    language: str
    code: str
    execution: Execution
    duration_ms: float
    started_at: str
    sandbox: dict
    source: str
    expected_output: str | None = None

    @property
    def succeeded(self) -> bool:
        """No error, or the exception its doctest documents (a doctest passes on it too)."""
        return self.execution.error is None or self.raised_as_expected

    @property
    def raised_as_expected(self) -> bool:
        """The error is the exception that the expected output's traceback ends with."""
        err, (_, want) = self.execution.error, split_expected(self.expected_output)
        if err is None or want is None:
            return False
        name, _, message = want.partition(":")
        if name.strip().rsplit(".", 1)[-1] != err.name:
            return False
        return "IGNORE_EXCEPTION_DETAIL" in self.code or _same_text(message, err.value)

    @property
    def output_text(self) -> str:
        """Everything the cell showed: stdout lines, then its results' text."""
        parts = list(self.execution.logs.stdout)
        parts += [r.text for r in self.execution.results if r.text]
        return "".join(p if p.endswith("\n") else p + "\n" for p in parts)

    def to_json(self) -> dict:
        ex = self.execution
        return {
            "id": self.id,
            "language": self.language,
            "code": self.code,
            "execution": {
                "results": [_result_dict(r) for r in ex.results],
                "logs": {"stdout": list(ex.logs.stdout), "stderr": list(ex.logs.stderr)},
                "error": None
                if ex.error is None
                else {
                    "name": ex.error.name,
                    "value": ex.error.value,
                    "traceback": ex.error.traceback,
                },
                "execution_count": ex.execution_count,
            },
            "duration_ms": self.duration_ms,
            "started_at": self.started_at,
            "sandbox": self.sandbox,
            "source": self.source,
            "expected_output": self.expected_output,
        }


_TRACEBACK_HEADER = re.compile(r"^Traceback \((?:most recent call|innermost) last\):\s*$", re.M)


def split_expected(expected: str | None) -> tuple[str, str | None]:
    """A doctest's expected output: (what it prints, the exception line it ends with or None).

    As doctest reads a traceback: after the header, the stack is indented (or '...') and
    the exception starts at the first line that begins with a letter, digit or '_'.
    """
    headers = list(_TRACEBACK_HEADER.finditer(expected or ""))
    if not headers:
        return expected or "", None
    header = headers[-1]
    lines = expected[header.end() :].splitlines()
    start = next((i for i, line in enumerate(lines) if line[:1].isalnum() or line[:1] == "_"), None)
    if start is None:
        return expected, None
    return expected[: header.start()], "\n".join(lines[start:]).strip()


def _same_text(want: str, got: str) -> bool:
    """Equal up to whitespace; '...' in `want` stands for any text (doctest's ELLIPSIS)."""
    want, got = " ".join(want.split()), " ".join(got.split())
    if "..." not in want:
        return want == got
    return re.fullmatch(".*?".join(map(re.escape, want.split("..."))), got, re.S) is not None


def _result_dict(result: Result) -> dict:
    out = {k: getattr(result, k) for k in _RESULT_FIELDS if getattr(result, k, None) is not None}
    out["is_main_result"] = bool(result.is_main_result)
    return out


class RecordError(ValueError):
    """A JSON object that is not an execution record; `reason` is a quarantine reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _field(obj: dict, key: str, types: tuple[type, ...], where: str, optional: bool = False):
    if key not in obj:
        if optional:
            return None
        raise RecordError(MISSING_FIELD, f"{where}{key} is missing")
    value = obj[key]
    if value is None and optional:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise RecordError(WRONG_TYPE, f"{where}{key} must be {names}, got {type(value).__name__}")
    return value


def _str_list(obj: dict, key: str, where: str) -> list[str]:
    lines = _field(obj, key, (list,), where, optional=True) or []
    for i, line in enumerate(lines):
        if not isinstance(line, str):
            raise RecordError(
                WRONG_TYPE, f"{where}{key}[{i}] must be str, got {type(line).__name__}"
            )
    return lines


def record_from_json(obj: dict) -> ExecutionRecord:
    """Validate one JSON object and build the record on E2B's models; raises RecordError."""
    language = _field(obj, "language", (str,), "")
    if language not in LANGUAGES:
        raise RecordError(WRONG_TYPE, f"language must be one of {LANGUAGES}, got {language!r}")
    ex = _field(obj, "execution", (dict,), "")
    logs = _field(ex, "logs", (dict,), "execution.", optional=True) or {}
    results = []
    for i, r in enumerate(_field(ex, "results", (list,), "execution.", optional=True) or []):
        if not isinstance(r, dict):
            raise RecordError(WRONG_TYPE, f"execution.results[{i}] must be an object")
        where = f"execution.results[{i}]."
        kept = {k: _field(r, k, types, where, optional=True) for k, types in _RESULT_FIELDS.items()}
        main = _field(r, "is_main_result", (bool,), where, optional=True)
        results.append(Result(**kept, is_main_result=bool(main)))
    error = _field(ex, "error", (dict,), "execution.", optional=True)
    if error is not None:
        error = ExecutionError(
            **{
                k: _field(error, k, (str,), "execution.error.")
                for k in ("name", "value", "traceback")
            }
        )
    count = _field(ex, "execution_count", (int,), "execution.", optional=True)
    if count is not None and count < 0:
        raise RecordError(OUT_OF_RANGE, f"execution.execution_count must be >= 0, got {count}")
    execution = Execution(
        results=results,
        error=error,
        logs=Logs(
            stdout=_str_list(logs, "stdout", "execution.logs."),
            stderr=_str_list(logs, "stderr", "execution.logs."),
        ),
        execution_count=count,
    )
    duration = _field(obj, "duration_ms", (int, float), "")
    if not math.isfinite(duration) or duration < 0:
        raise RecordError(OUT_OF_RANGE, f"duration_ms must be a finite number >= 0, got {duration}")
    return ExecutionRecord(
        id=_field(obj, "id", (str,), ""),
        language=language,
        code=_field(obj, "code", (str,), ""),
        execution=execution,
        duration_ms=float(duration),
        started_at=_field(obj, "started_at", (str,), "", optional=True) or "",
        sandbox=_field(obj, "sandbox", (dict,), "", optional=True) or {},
        source=_field(obj, "source", (str,), "", optional=True) or "",
        expected_output=_field(obj, "expected_output", (str,), "", optional=True),
    )


def parse_records(
    path: Path, quarantine: Quarantine, max_line_bytes: int = 1 << 20
) -> Iterator[ExecutionRecord]:
    """Records of one JSONL file; every malformed line goes to the quarantine, none stops it."""
    for line_no, obj in read_json_lines(path, quarantine, max_line_bytes):
        try:
            yield record_from_json(obj)
        except RecordError as err:
            quarantine.add(str(path), line_no, err.reason, str(err), json.dumps(obj)[:2000])


def utf8_text(obj):
    """Lone surrogates (half a UTF-16 pair, from code or output) replaced, so logs are UTF-8."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "replace").decode("utf-8")
    if isinstance(obj, list):
        return [utf8_text(v) for v in obj]
    if isinstance(obj, dict):
        return {k: utf8_text(v) for k, v in obj.items()}
    return obj


def write_records(path: Path, records: list[ExecutionRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(utf8_text(record.to_json()), ensure_ascii=False) + "\n")
