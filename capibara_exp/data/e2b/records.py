"""E2B Code Interpreter execution records: one JSONL line per executed cell.

Two shapes are read, told apart per line (record.schema.json says which keys each has):
- nested (what the collector writes): `{"id", "language", "code", "execution": {"results",
  "logs": {"stdout", "stderr"}, "error", "execution_count"}, "duration_ms", ...}`;
- flat, the E2B SDK's own: `{"id"?, "code", "language", **json.loads(execution.to_json()),
  "execution_count"?, "duration"?}`, with `logs` and `error` as JSON text or objects.
`id` is optional (a content hash of the scrubbed record when absent, marked derived);
a duration is in milliseconds under `duration_ms`, in seconds under `duration_s` or
`duration`. `parse_records` turns a file into `ExecutionRecord`s on the SDK's models and
sends each malformed line to the quarantine with its reason and the failing JSON path.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from e2b_code_interpreter.models import Execution, ExecutionError, Logs, Result

from capibara_exp.data.e2b import schema
from capibara_exp.data.e2b.jsonl import read_json_lines
from capibara_exp.data.e2b.quarantine import Quarantine

# The languages E2B's runtimes run (and SQL, which the collector runs on sqlite3). Any other
# language name is accepted and recorded as given; only the code's own checks differ.
LANGUAGES = ("python", "javascript", "typescript", "r", "java", "bash", "sql")
# Result formats kept (images, PDFs and charts are not training text and are dropped).
TEXT_FORMATS = ("text", "html", "markdown", "latex", "json", "javascript", "data", "extra")


@dataclasses.dataclass
class ExecutionRecord:
    """One executed cell: the code, E2B's Execution, timing and where it ran."""

    id: str | None
    language: str
    code: str
    execution: Execution
    duration_ms: float | None
    started_at: str = ""
    sandbox: dict = dataclasses.field(default_factory=dict)
    source: str = ""
    expected_output: str | None = None
    origin: tuple[str, int] = ("", 0)  # (input file, line): where it was read
    shape: str = schema.NESTED

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
    def stdout(self) -> str:
        return "".join(self.execution.logs.stdout)

    @property
    def stderr(self) -> str:
        return "".join(self.execution.logs.stderr)

    @property
    def output_text(self) -> str:
        """Everything the cell showed: its stdout, then its results' text, a line each."""
        parts = [self.stdout] if self.stdout else []
        parts += [r.text for r in self.execution.results if r.text]
        return "".join(p if p.endswith("\n") else p + "\n" for p in parts)

    def to_json(self) -> dict:
        """The nested shape (what the collector writes and the parser reads back)."""
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
    out = {k: getattr(result, k) for k in TEXT_FORMATS if getattr(result, k, None) is not None}
    out["is_main_result"] = bool(result.is_main_result)
    return out


def _duration_ms(obj: dict) -> float | None:
    if obj.get("duration_ms") is not None:
        return float(obj["duration_ms"])
    seconds = obj.get("duration_s", obj.get("duration"))
    return None if seconds is None else float(seconds) * 1e3


def _nested(obj: dict) -> dict:
    """A validated record of either shape in the nested shape."""
    if schema.shape(obj) == schema.NESTED:
        out = dict(obj)
    else:
        out = {k: v for k, v in obj.items() if k not in ("results", "logs", "error")}
        out["execution"] = {
            k: obj[k] for k in ("results", "logs", "error", "execution_count") if k in obj
        }
    out["duration_ms"] = _duration_ms(obj)
    return out


def from_nested(obj: dict, origin: tuple[str, int] = ("", 0), shape: str = schema.NESTED):
    """The record of a valid nested-shape object (as `to_json` writes it)."""
    ex = obj.get("execution") or {}
    logs, error, count = ex.get("logs") or {}, ex.get("error"), ex.get("execution_count")
    execution = Execution(
        results=[
            Result(
                **{k: r[k] for k in TEXT_FORMATS if r.get(k) is not None},
                is_main_result=bool(r.get("is_main_result")),
            )
            for r in ex.get("results") or []
        ],
        logs=Logs(stdout=list(logs.get("stdout") or []), stderr=list(logs.get("stderr") or [])),
        error=None
        if error is None
        else ExecutionError(error["name"], error["value"], error["traceback"]),
        execution_count=None if count is None else int(count),
    )
    return ExecutionRecord(
        id=obj.get("id"),
        language=obj["language"],
        code=obj["code"],
        execution=execution,
        duration_ms=obj.get("duration_ms"),
        started_at=obj.get("started_at") or "",
        sandbox=obj.get("sandbox") or {},
        source=obj.get("source") or "",
        expected_output=obj.get("expected_output"),
        origin=origin,
        shape=shape,
    )


def record_from_json(obj: dict, origin: tuple[str, int] = ("", 0)) -> ExecutionRecord:
    """Validate one JSON object (either shape) and build the record on E2B's models."""
    obj = schema.validate(obj)
    return from_nested(_nested(obj), origin, schema.shape(obj))


def parse_records(
    path: Path,
    quarantine: Quarantine,
    max_line_bytes: int = 1 << 20,
    ignored: Counter | None = None,
) -> Iterator[ExecutionRecord]:
    """Records of one JSONL file; every malformed line goes to the quarantine, none stops it.

    Top-level keys the schema does not name are counted in `ignored`."""
    for line_no, obj in read_json_lines(path, quarantine, max_line_bytes):
        try:
            record = record_from_json(obj, (str(path), line_no))
        except schema.RecordError as err:
            quarantine.add(
                str(path), line_no, err.reason, err.detail, json.dumps(obj, ensure_ascii=False)
            )
            continue
        if ignored is not None:
            ignored.update(k[:40] for k in obj if k not in schema.known_keys())
        yield record


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
