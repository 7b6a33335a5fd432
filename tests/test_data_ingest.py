"""Logs from the outside world through the whole build: the E2B SDK's own record shape,
every malformation named in issue 12, property-based torture (arbitrary bytes, arbitrary
JSON, mutated records), and no secret at rest in anything a build writes.

Builds here read tiny inputs (`collect.sources=[]`); the scrubbing gate is measured once
per process and reused.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from e2b_code_interpreter.models import Execution, ExecutionError, Logs, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capibara_exp.data.e2b import build, heldout, processing, records
from capibara_exp.data.e2b.heldout import credential_formats, tokens
from capibara_exp.data.e2b.quarantine import Quarantine

_RELAXED = {"min_code_chars": 0, "dedup": [], "drop_sandbox_errors": False}


def sdk_line(code: str, execution: Execution, **extra) -> dict:
    """What a user of the SDK logs: {code, language, **json.loads(execution.to_json())}."""
    return {"code": code, "language": "python", **json.loads(execution.to_json()), **extra}


def _ok(stdout: str = "hi\n", text: str = "2") -> Execution:
    return Execution(results=[Result(text=text, is_main_result=True)], logs=Logs(stdout=[stdout]))


def _failed(value: str = "division by zero") -> Execution:
    tb = f'Traceback (most recent call last):\n  File "<cell>", line 1\nZeroDivisionError: {value}'
    return Execution(
        error=ExecutionError("ZeroDivisionError", value, tb), logs=Logs(stderr=["warn: x\n"])
    )


def _cfg(*logs: Path, **overrides) -> dict:
    filters = {**_RELAXED, **overrides.pop("filters", {})}
    return build.build_config(
        {
            "collect": {"sources": []},
            "inputs": {"logs": [str(p) for p in logs]},
            "filters": filters,
            **overrides,
        }
    )


def _examples(data_dir: Path) -> dict[tuple[str, int], dict]:
    path = build.dataset_dir(data_dir) / "examples" / "examples.jsonl"
    rows = [json.loads(line) for line in path.read_bytes().split(b"\n") if line]
    return {(r["origin"]["file"], r["origin"]["line"]): r for r in rows}


def _quarantined(data_dir: Path) -> list[dict]:
    path = build.dataset_dir(data_dir) / "quarantine" / "logs.quarantine.jsonl"
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line]


def same_but_redacted(got: str, want: str) -> bool:
    """`got` is `want`, except where a `<REDACTED:kind>` stands for some of its text."""
    if "<REDACTED:" not in got:
        return got == want
    parts = re.split(r"<REDACTED:[a-z0-9_]+>", got)
    return re.fullmatch(".+?".join(map(re.escape, parts)), want, re.S) is not None


def assert_kept(example: dict, record: dict) -> None:
    """The example holds the record's texts as they were (but for redactions)."""
    logs, error = record.get("logs") or {}, record.get("error")
    logs = json.loads(logs) if isinstance(logs, str) else logs
    error = json.loads(error) if isinstance(error, str) else error
    pairs = [
        (example["code"], record["code"]),
        (example["stdout"], "".join(logs.get("stdout", []))),
        (example["stderr"], "".join(logs.get("stderr", []))),
        (
            "\0".join(example["results"]),
            "\0".join(r["text"] for r in record["results"] if r.get("text")),
        ),
    ]
    if error:
        pairs += [(example["error"][k], error[k]) for k in ("name", "value", "traceback")]
    for got, want in pairs:
        assert same_but_redacted(got, want), (got, want)


def test_sdk_records_of_both_shapes_build_and_come_out_unchanged(tmp_path: Path) -> None:
    lines = [
        sdk_line("print('hi')\n1 + 1", _ok(), execution_count=1, duration=0.25),
        sdk_line("1/0", _failed(), id="cell-2"),
        # logs and error as objects (not JSON text), a duration in ms, an extra key
        {
            "code": "x = 1",
            "language": "python",
            "results": [],
            "logs": {"stdout": ["a\n"]},
            "error": None,
            "duration_ms": 3,
            "notebook": "n.ipynb",
        },
        {
            "id": "n1",
            "code": "SELECT 1;",
            "language": "sql",
            "duration_ms": 1.5,
            "execution": {
                "results": [{"text": "[(1,)]", "is_main_result": True}],
                "logs": {"stdout": [], "stderr": []},
                "error": None,
            },
        },
    ]
    path = tmp_path / "sdk.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    manifest = build.build(tmp_path / "d", _cfg(path))
    got = _examples(tmp_path / "d")
    assert sorted(line for _, line in got) == [1, 2, 3, 4]
    for i, line in enumerate(lines[:3], start=1):
        assert_kept(got[(str(path), i)], line)
    first, second = got[(str(path), 1)], got[(str(path), 2)]
    assert first["id_derived"] and first["id"].startswith("sha256-") and first["duration_ms"] == 250
    assert second["id"] == "cell-2" and not second["id_derived"] and second["duration_ms"] is None
    assert got[(str(path), 3)]["duration_ms"] == 3 and got[(str(path), 4)]["results"] == ["[(1,)]"]
    counts = manifest["inputs"][str(path)]
    assert counts["accepted"] == 4 and counts["quarantined"] == 0
    assert counts["ignored_keys"] == {"notebook": 1}
    # stderr and the traceback reach the debug domain's text
    debug = (build.dataset_dir(tmp_path / "d") / "routing" / "debug").glob("*.jsonl")
    texts = " ".join(p.read_text() for p in debug)
    assert "warn: x" in texts and "### traceback" in texts and "ZeroDivisionError" in texts


_NAMED = [  # (line, reason, the start of its detail)
    (
        b'{"code": "x", "language": "python", "results": [], "logs": {}, "error": null, '
        b'"execution_count": ' + b"9" * 5000 + b"}",
        "invalid_json",
        "an integer literal of 5000",
    ),
    (
        b'{"code": "\\udc00", "language": "python", "results": [], "logs": {}, "error": null}',
        "invalid_unicode",
        "$.code: a lone UTF-16 surrogate",
    ),
    (
        b'{"code": "1", "language": "python", "results": [], "logs": {"stdout": ["\\ud800x"]}, '
        b'"error": null}',
        "invalid_unicode",
        "$.logs.stdout[0]: a lone UTF-16 surrogate",
    ),
    (
        b'{"code": "1", "language": "python", "results": [], "logs": null, "error": null}',
        "wrong_type",
        "$.logs: expected object, got null",
    ),
    (
        b'{"code": "1", "language": "python", "results": [], "logs": {"stdout": null}, '
        b'"error": null}',
        "wrong_type",
        "$.logs.stdout: expected array, got null",
    ),
    (
        b'{"code": "1", "code": "2", "language": "python", "results": [], "logs": {}, '
        b'"error": null}',
        "duplicate_key",
        "$: key 'code' appears more than once",
    ),
    (
        b'{"code": "1", "language": "python", "results": [], "error": null, '
        b'"logs": "{\\"stdout\\": [], \\"stdout\\": [\\"x\\"]}"}',
        "duplicate_key",
        "$.logs (JSON text, as Execution.to_json writes it): $: key 'stdout'",
    ),
    (b'{"code": "caf\xe9", "language": "python"}', "invalid_utf8", "not UTF-8"),
    (
        b'{"code": "1", "language": "python", "results": [], "logs": {}, "error": null, '
        b'"duration": 1, "duration_ms": 1000}',
        "invalid_value",
        "$: more than one duration",
    ),
    (
        b'{"code": "1", "language": "python", "execution": {}, "logs": {}}',
        "invalid_value",
        "$: both shapes in one record",
    ),
    (
        b'{"code": "1", "language": "", "results": [], "logs": {}, "error": null}',
        "invalid_value",
        "$.language: must not be empty",
    ),
    (
        b'{"code": "1", "language": "python", "results": [], "logs": {}, '
        b'"error": {"name": "E", "value": "v"}}',
        "missing_field",
        "$.error.traceback: missing",
    ),
]
# Valid Unicode that must come out byte for byte: U+202F grouping, ZWJ emoji, bidi marks.
_UNICODE = "n = 1\u202f234\u202f567  # 👩\u200d💻 \u200fשלום\u200f  ÷ 🇺🇦"


def test_every_named_malformation_is_quarantined_naming_its_path(tmp_path: Path) -> None:
    valid = sdk_line(_UNICODE, _ok(stdout="1\u202f234\u202f567 👩\u200d💻\n"))
    raw = [json.dumps(valid, ensure_ascii=False).encode()] + [b for b, _, _ in _NAMED]
    path = tmp_path / "named.jsonl"
    path.write_bytes(b"\n".join(raw) + b"\n")
    manifest = build.build(tmp_path / "d", _cfg(path))
    entries = {e["line"]: e for e in _quarantined(tmp_path / "d")}
    for line_no, (_, reason, detail) in enumerate(_NAMED, start=2):
        assert entries[line_no]["reason"] == reason, (line_no, entries[line_no])
        assert entries[line_no]["detail"].startswith(detail), (line_no, entries[line_no])
    example = _examples(tmp_path / "d")[(str(path), 1)]
    assert example["code"].encode() == _UNICODE.encode()
    assert example["stdout"].encode() == "1\u202f234\u202f567 👩\u200d💻\n".encode()
    counts = manifest["inputs"][str(path)]
    assert counts["accepted"] == 1 and counts["quarantined"] == len(_NAMED)


def test_an_input_with_nothing_accepted_or_too_few_domains_is_an_error(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps(sdk_line("print(1)", _ok())) + "\n")
    bad.write_bytes(b"\n".join(b for b, _, _ in _NAMED[:4]) + b"\n")
    with pytest.raises(
        build.BuildError,
        match=r"inputs.logs\[1\]: .*bad.jsonl: no record "
        r"accepted, 4 line\(s\) quarantined \(top reasons: invalid_unicode 2, ",
    ):
        build.build(tmp_path / "d", _cfg(good, bad))
    manifest = build.build(tmp_path / "d", _cfg(good))  # the good file alone builds
    assert "'sql' left out of its mixture: 0 example(s)" in " | ".join(manifest["warnings"])
    assert set(manifest["routing"]["left_out"]) >= {"sql", "javascript", "ml", "api"}
    with pytest.raises(build.BuildError, match=r"require_all_domains=true, but domain\(s\)"):
        build.build(tmp_path / "d", _cfg(good, require_all_domains=True))


def test_a_record_failing_in_processing_is_quarantined_and_the_build_goes_on(
    tmp_path: Path,
) -> None:
    deep = sdk_line("1+" * 100_000 + "1", _ok())  # over ast's recursion limit: features
    path = tmp_path / "deep.jsonl"  # fall back to patterns, the record is kept
    path.write_text(json.dumps(deep) + "\n")
    build.build(tmp_path / "d", _cfg(path, filters={"max_code_chars": 300_000}))
    assert _examples(tmp_path / "d")[(str(path), 1)]["features"]["chars"] == 200_001
    # a record no parser gives (code that is not text) fails for real in processing
    good = records.record_from_json(sdk_line("print(1)", _ok()), ("log.jsonl", 1))
    odd = records.record_from_json(sdk_line("print(2)", _ok()), ("log.jsonl", 2))
    odd.code = None
    q = Quarantine()
    examples, stats = processing.process([odd, good], processing.Filters(), q)
    assert [e["origin"]["line"] for e in examples] == [1]
    assert [(e["line"], e["reason"], e["detail"]) for e in q.entries] == [
        (2, "processing_error", "features: AttributeError")
    ]
    assert stats["per_file"]["log.jsonl"] == {"accepted": 1, "examples": 1}


# ---- every language E2B runs, in the SDK's shape ----

_FRAME = (
    "   service                              api_key                request_id\n"
    "0  billing  {tok}  3f2a9c1e7b4d4e8a9f1c2d3e\n"
    "1   search                                  NaN  7b4d4e8a9f1c2d3e3f2a9c1e"
)
_HTML = (
    '<table border="1" class="dataframe">\n<thead><tr style="text-align: right;"><th></th>'
    "<th>service</th><th>api_key</th></tr></thead>\n<tbody>\n<tr><th>0</th><td>billing</td>"
    "<td>{tok}</td></tr>\n</tbody>\n</table>"
)
_ANSI_TB = (
    "\x1b[0;31m---------------------------------------------------------------------------\x1b[0m\n"
    "\x1b[0;31mZeroDivisionError\x1b[0m                         Traceback (most recent call last)\n"
    "Cell \x1b[0;32mIn[3], line 2\x1b[0m\n\x1b[1;32m----> 2\x1b[0m \x1b[38;5;241m1\x1b[39m "
    "\x1b[38;5;241m/\x1b[39m \x1b[38;5;241m0\x1b[39m\n\n"
    "\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"
)


def _mixed_records(tok: str, pw: str) -> list[dict]:
    """Cells as an E2B SDK user logs them, one per language the runtimes run (and SQL)."""
    def line(language, code, execution, **extra):
        return {"code": code, "language": language, **json.loads(execution.to_json()), **extra}

    ok = lambda **kw: Execution(**kw)  # noqa: E731
    return [
        line("python", "import pandas as pd\ndf = pd.read_csv('keys.csv')\ndf",
             ok(results=[Result(text=_FRAME.format(tok=tok), html=_HTML.format(tok=tok),
                                is_main_result=True)]), execution_count=3, duration=0.4),
        line("python", "1 / 0", ok(error=ExecutionError("ZeroDivisionError", "division by zero",
                                                        _ANSI_TB)), execution_count=4),
        line("bash", f"export QZV_TOKEN={tok}\nls /tmp | head -2",
             ok(logs=Logs(stdout=["cache\n", "logs\n"]))),
        line("bash", f"ldapsearch -x -D cn=admin,dc=org -w {pw} -b dc=org",
             ok(logs=Logs(stderr=["ldap_bind: Invalid credentials (49)\n"]),
                error=ExecutionError("ExitCode", "49", "exit status 49"))),
        line("r", "x <- c(1, 2, 3)\nsummary(x)",
             ok(logs=Logs(stdout=["   Min. 1st Qu.  Median    Mean 3rd Qu.    Max. \n",
                                  "    1.0     1.5     2.0     2.0     2.5     3.0 \n"]))),
        line("r", 'stop("bad input")',
             ok(error=ExecutionError("Error", "bad input", "Error in eval(expr): bad input"))),
        line("javascript", "const xs = [1, 2, 3].map((x) => x * 2);\nconsole.log(xs);",
             ok(logs=Logs(stdout=["[ 2, 4, 6 ]\n"]))),
        line("javascript", "undefinedFn()",
             ok(error=ExecutionError("ReferenceError", "undefinedFn is not defined",
                                     "ReferenceError: undefinedFn is not defined\n  at <anon>"))),
        line("typescript", f"const client = new QzvClient('{tok}');\nconst n: number = 2;\nn * 21",
             ok(results=[Result(text="42", is_main_result=True)])),
        line("java", 'System.out.println("hello " + 40 + 2);',
             ok(logs=Logs(stdout=["hello 402\n"]))),
        line("sql", "SELECT service, COUNT(*) AS n FROM calls GROUP BY service;",
             ok(results=[Result(text=" service | n\n---------+---\n billing | 4\n(1 row)",
                                is_main_result=True)]), id="sql-1"),
        line("deno", "console.log(Deno.version.deno)", ok(logs=Logs(stdout=["2.1.4\n"]))),
    ]


def test_a_mixed_language_sdk_log_keeps_every_valid_record(tmp_path: Path) -> None:
    tok, pw = "qzv_live_Tk8mW2xQ9rLp4ZbN7cYd3FhJ6sVg", "Harbor1887#"
    lines = _mixed_records(tok, pw)
    path = tmp_path / "sdk_mixed.jsonl"
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    manifest = build.build(tmp_path / "d", _cfg(path))
    counts = manifest["inputs"][str(path)]
    assert counts["accepted"] == len(lines) and counts["quarantined"] == 0, counts
    got = _examples(tmp_path / "d")
    assert sorted(n for _, n in got) == list(range(1, len(lines) + 1))
    for i, line in enumerate(lines, start=1):
        assert got[(str(path), i)]["language"] == line["language"]  # recorded as given
        assert_kept(got[(str(path), i)], line)
    written = " ".join(p.read_text() for p in (tmp_path / "d").rglob("*") if p.is_file())
    assert tok not in written and pw not in written and "Tk8mW2xQ9rLp" not in written
    assert "3f2a9c1e7b4d4e8a9f1c2d3e" in written  # an id beside it stays
    assert manifest["secrets_found_at_rest"] == {}
    languages = manifest["processing"]["languages"]
    assert set(languages) == {"python", "bash", "r", "javascript", "typescript", "java", "sql",
                              "deno"}


# ---- property-based: nothing on a line can stop the build or change another line ----

_VALID = [sdk_line("print('first')", _ok("first\n")), sdk_line("1/0", _failed("second"))]
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _build_lines(middle: list[bytes]) -> dict:
    """Build a log of the two valid records around `middle`: every line is accounted for,
    the valid records come out unchanged, every quarantine entry names a line."""
    with tempfile.TemporaryDirectory(prefix="capibara-ingest-") as name:
        tmp = Path(name)
        path = tmp / "log.jsonl"
        raw = [json.dumps(_VALID[0]).encode(), *middle, json.dumps(_VALID[1]).encode()]
        data = b"\n".join(raw) + b"\n"
        path.write_bytes(data)
        manifest = build.build(tmp / "d", _cfg(path))
        counts = manifest["inputs"][str(path)]
        lines = [line for line in data.split(b"\n") if line.strip()]
        assert counts["accepted"] + counts["quarantined"] == len(lines), counts
        examples, n_lines = _examples(tmp / "d"), data.count(b"\n")
        for line_no, record in ((1, _VALID[0]), (n_lines, _VALID[1])):
            assert_kept(examples[(str(path), line_no)], record)
        for entry in _quarantined(tmp / "d"):
            assert entry["reason"] and 1 <= entry["line"] <= n_lines
    return manifest


_PROPERTY = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_PROPERTY
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_arbitrary_bytes_never_stop_the_build(middle: list[bytes]) -> None:
    _build_lines(middle)


@_PROPERTY
@given(st.lists(_json, max_size=6))
def test_arbitrary_json_values_never_stop_the_build(values: list) -> None:
    _build_lines([json.dumps(v, ensure_ascii=False).encode() for v in values])


def _mutate(record: dict, data: st.DataObject) -> bytes:
    """One mutation of a valid SDK record: a key dropped or retyped, a value replaced at
    any depth, the line cut, bytes spliced in, a key duplicated."""
    obj = json.loads(json.dumps(record))
    how = data.draw(st.sampled_from(["drop", "replace", "nested", "cut", "splice", "dup"]))
    key = data.draw(st.sampled_from(sorted(obj)))
    if how == "drop":
        del obj[key]
    elif how == "replace":
        obj[key] = data.draw(_json)
    elif how == "nested":
        obj["logs"] = {"stdout": data.draw(_json), "stderr": data.draw(_json)}
        obj["results"] = [data.draw(_json)]
    line = json.dumps(obj, ensure_ascii=False).encode()
    if how == "cut":
        line = line[: data.draw(st.integers(0, len(line) - 1))]
    elif how == "splice":
        at = data.draw(st.integers(0, len(line)))
        line = line[:at] + data.draw(st.binary(min_size=1, max_size=8)) + line[at:]
    elif how == "dup":
        line = line[:-1] + b", " + json.dumps({key: obj[key]})[1:].encode()
    return line


@_PROPERTY
@given(st.data())
def test_mutated_valid_records_never_stop_the_build(data: st.DataObject) -> None:
    records = [_VALID[0], _VALID[1], sdk_line("SELECT 1;", _ok(), language="sql")]
    middle = [_mutate(data.draw(st.sampled_from(records)), data) for _ in range(4)]
    assert _build_lines(middle)["inputs"]  # the build went on


# ---- secrets at rest ----


def _planted() -> list[tuple[str, str]]:
    """(text to plant, the secret in it), from the held-out formats, seeded apart."""
    rng = random.Random(4242)
    by_name = {f.name: f for f in credential_formats.FORMATS}
    s = {
        n: by_name[n].make(rng)
        for n in (
            "github_classic_token",
            "aws_access_key_id",
            "openai_key",
            "slack_bot_token",
            "private_key",
        )
    }
    pw = credential_formats.human_password(rng)
    url_pw = credential_formats.random_password(rng).replace("%", "")
    vendor = "qzv_" + tokens.token(rng, "base62", "bare")
    pw2 = credential_formats.human_password(rng)
    built_on_uuid = tokens.token(random.Random(3), "hex", "uuid_built")
    while tokens.UUID_ONLY.fullmatch(built_on_uuid):
        built_on_uuid = tokens.token(rng, "hex", "uuid_built")
    return [
        (f'client = Github("{s["github_classic_token"]}")', s["github_classic_token"]),
        (f'aws_access_key_id = "{s["aws_access_key_id"]}"', s["aws_access_key_id"]),
        (f"OPENAI_API_KEY={s['openai_key']}", s["openai_key"]),
        (f"token in use: {s['slack_bot_token']}", s["slack_bot_token"]),
        (f'password = "{pw}"', pw),
        (f"postgresql://app:{url_pw}@db:5432/shop", url_pw),
        (s["private_key"], s["private_key"]),
        # never-named formats where only the context tells (issue 23)
        (f"client = Client('{vendor}')", vendor),
        (f"ldapsearch -x -D cn=admin,dc=org -w {pw2} -b dc=org", pw2),
        (f"access_token={built_on_uuid}", built_on_uuid),
        (f"   service  api_key\n0  billing  {vendor[::-1]}", vendor[::-1]),
        (f"401 Unauthorized: credential {vendor.upper()} is not valid", vendor.upper()),
    ]


def _secret_lines(planted: list[tuple[str, str]]) -> list[bytes]:
    """Every planted text in valid records and in each kind of malformed line."""
    out = []
    for i, (text, _) in enumerate(planted):
        ok = sdk_line(f"# cell {i}\n{text}", _failed(f"bad value: {text}"))
        ok["logs"] = json.dumps({"stdout": [text + "\n"], "stderr": [text]})
        out.append(json.dumps(ok).encode())
        bad = json.dumps({"code": text, "language": "python", "logs": None}).encode()
        out += [
            bad,  # wrong type
            bad[: len(bad) // 2 + 20],  # truncated
            bad.replace(b'"code"', b'"code": 1, "code"', 1),  # duplicate key
            b"\xff" + bad,  # not UTF-8
            bad.replace(b'"language"', b'"note": "\\udc00", "language"', 1),  # lone surrogate
            json.dumps({"code": text, "language": "python", "results": 7}).encode(),
            json.dumps({**ok, "logs": {"stdout": None, "stderr": [text]}}).encode(),
            json.dumps(ok).encode()[:-1] + b', "execution_count": ' + b"7" * 4400 + b"}",
        ]
    return out


def _leaks(text: str, planted: list[tuple[str, str]]) -> list[str]:
    found = []
    for _, secret in planted:
        for form in (secret, json.dumps(secret)[1:-1]):
            if not heldout.caught(text, form):
                found.append(secret[:12])
    return found


@pytest.mark.entry
def test_no_secret_is_at_rest_in_anything_a_build_writes_or_prints(tmp_path: Path) -> None:
    planted = _planted()
    log = tmp_path / "secrets.jsonl"  # with a valid line of Unicode that must come out as is
    unicode = json.dumps(sdk_line(_UNICODE, _ok()), ensure_ascii=False).encode()
    log.write_bytes(b"\n".join([*_secret_lines(planted), unicode]) + b"\n")
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_bytes(b"\n".join(_secret_lines(planted)[1:7]) + b"\n")
    cli = [
        sys.executable,
        "-c",
        "from capibara_exp.cli.data import main; main()",
        f"data_dir={tmp_path / 'data'}",
        "collect.sources=[]",
        "filters.min_code_chars=0",
    ]
    done = subprocess.run(
        [*cli, f"inputs.logs=[{log}]"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["inputs"][str(log)]["accepted"] == len(planted) + 1, summary["inputs"]
    examples = (build.dataset_dir(tmp_path / "data") / "examples" / "examples.jsonl").read_bytes()
    assert json.dumps(_UNICODE, ensure_ascii=False).encode() in examples
    failed = subprocess.run(
        [*cli, "force=true", f"inputs.logs=[{only_bad}]"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert failed.returncode == 2 and "no record accepted" in failed.stderr, failed.stderr
    written = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
    assert any(p.name == "logs.quarantine.jsonl" for p in written)
    for name, text in [(str(p), p.read_text(errors="replace")) for p in written] + [
        ("stdout", done.stdout + failed.stdout),
        ("stderr", done.stderr + failed.stderr),
    ]:
        assert not _leaks(text, planted), (name, _leaks(text, planted))
