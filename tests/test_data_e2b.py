"""E2B execution logs: sandbox, collector on real snippets, parser and its quarantine.

(Records in the SDK's shape, malformations through the whole build and secrets at rest:
test_data_ingest.py; the scrubber: test_data_scrub.py.)"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capibara_exp.data.e2b import collector, features, jsonl, quarantine, sandbox, snippets
from capibara_exp.data.e2b.records import (
    parse_records,
    record_from_json,
    split_expected,
    write_records,
)
from capibara_exp.data.e2b.schema import RecordError

needs_node = pytest.mark.skipif(sandbox.node_binary() is None, reason="node is not installed here")


@functools.cache
def _all_stdlib() -> tuple[snippets.Snippet, ...]:
    return tuple(snippets.stdlib_doctests())


def _stdlib(module: str, n: int = 2) -> list[snippets.Snippet]:
    found = [s for s in _all_stdlib() if s.module == module]
    assert found, f"no doctests found in stdlib module {module}"
    return found[:n]


@pytest.mark.slow
def test_collector_runs_real_doctests_and_sql(tmp_path: Path) -> None:
    doctests = _stdlib("difflib", 1) + _stdlib("json", 1)
    sql = list(snippets.sqlite_statements())[:3]
    records = collector.collect_local(doctests + sql, sandbox.Limits())
    assert [r.id for r in records] == [s.id for s in doctests + sql]
    for rec in records[:2]:  # stdlib doctests show exactly their documented output
        assert rec.succeeded, rec.execution.error
        assert features.expected_match(rec) == 1.0, (rec.output_text, rec.expected_output)
        assert rec.execution.execution_count == 1 and rec.sandbox["engine"] == "local-subprocess"
    assert all(r.language == "sql" for r in records[2:])
    # Round trip through the JSONL file: the parser gives back the same records.
    path = tmp_path / "logs.jsonl"
    write_records(path, records)
    q = quarantine.Quarantine()
    parsed = list(parse_records(path, q))
    assert not q.counts
    assert [p.to_json() for p in parsed] == [r.to_json() for r in records]


def test_sandbox_reports_errors_timeouts_memory_and_no_network() -> None:
    cells = [
        {"id": "err", "code": "def f(x):\n    return 1 / x\nf(0)", "reset": True},
        {"id": "loop", "code": "while True:\n    pass"},
        {"id": "mem", "code": "b = bytearray(8 << 30)"},
        {
            "id": "net",
            "code": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
        },
        {"id": "cwd", "code": "import os\nos.getcwd()"},
    ]
    out = {
        o["id"]: o for o in sandbox.run_cells("python", cells, sandbox.Limits(cell_timeout_s=1.0))
    }
    assert out["err"]["error"]["name"] == "ZeroDivisionError"
    assert 'File "<cell>", line 2, in f' in out["err"]["error"]["traceback"]
    assert out["loop"]["error"]["name"] == "TimeoutError"
    assert out["mem"]["error"]["name"] == "MemoryError"
    assert out["net"]["error"] is not None and out["net"]["error"]["name"] in (
        "OSError",
        "gaierror",
    )
    workdir = out["cwd"]["results"][0]["text"].strip("'")
    assert "capibara-sandbox-" in workdir and not os.path.exists(workdir)  # a temp dir, removed


@needs_node
def test_javascript_cells_run_under_node() -> None:
    cells = [
        {
            "id": "ok",
            "code": "const xs = [1, 2, 3].map(x => x * 2);\nconsole.log(xs.length);\nxs",
            "reset": True,
        },
        {"id": "bad", "code": "null.f", "reset": True},
    ]
    ok, bad = sandbox.run_cells("javascript", cells)
    assert (
        ok["error"] is None
        and ok["stdout"] == ["3\n"]
        and ok["results"][0]["text"] == "[ 2, 4, 6 ]"
    )
    assert bad["error"]["name"] == "TypeError"


_NET_CELLS = {
    "javascript": [
        "require('net').connect(53, '1.1.1.1')",
        "require('http').get('http://example.com/')",
        "require('dns').lookup('example.com', () => {})",
        "require('dgram').createSocket('udp4').send('x', 53, '1.1.1.1')",
    ],
    "python": [
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
        "import socket\nsocket.getaddrinfo('example.com', 80)",
        "import urllib.request\nurllib.request.urlopen('http://1.1.1.1/', timeout=1)",
    ],
}


@needs_node
def test_without_namespaces_cells_of_every_language_still_have_no_network(monkeypatch) -> None:
    # Where `unshare -rn` is not allowed, the runners themselves refuse connections.
    monkeypatch.setattr(sandbox, "network_isolation", lambda: sandbox.IN_PROCESS)
    for language, codes in _NET_CELLS.items():
        cells = [{"id": str(i), "code": c, "reset": True} for i, c in enumerate(codes)]
        for cell, out in zip(cells, sandbox.run_cells(language, cells), strict=True):
            assert out["error"] is not None, (language, cell["code"])
            assert "network access is disabled in this sandbox" in out["error"]["value"], out
        assert sandbox.sandbox_metadata(language)["network"] == sandbox.IN_PROCESS


@needs_node
def test_node_screens_out_javascript_that_does_not_parse() -> None:
    codes = {
        "script": "const xs = [1, 2];\nxs.map((x) => x * 2)",
        "module": "import fs from 'fs';\nexport const n = 1;",
        "await": "await Promise.resolve(1)",
        "fragment": "app.get('/', (req, res) => {\n  ...\n})",
        "shell": "$ npm install --save left-pad",
    }
    errors = sandbox.javascript_syntax_errors(codes)
    assert sorted(errors) == ["fragment", "shell"]
    assert all(e.startswith("SyntaxError: ") for e in errors.values()), errors


def test_a_doctest_that_raises_its_documented_exception_succeeded() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / "pickletools.py", stdlib / "_threading_local.py"]
    found = snippets._doctest_snippets(files, stdlib, "stdlib-doctest")
    raising = [s for s in found if split_expected(s.expected_output)[1]][-3:]
    assert len(raising) == 3, "these stdlib modules document exceptions in their doctests"
    other = snippets.Snippet(
        "wrong",
        "python",
        "int('x')\n",
        "test",
        expected_output="Traceback (most recent call last):\n  ...\nKeyError: 'x'\n",
    )
    records = collector.collect_local([*raising, other], sandbox.Limits())
    for rec in records[:-1]:
        assert rec.execution.error is not None and rec.raised_as_expected, rec.to_json()
        assert rec.succeeded and features.expected_match(rec) == 1.0, rec.to_json()
    assert records[-1].execution.error.name == "ValueError" and not records[-1].succeeded


def _good_line() -> dict:
    return {
        "id": "a",
        "language": "python",
        "code": "1 + 1",
        "duration_ms": 0.5,
        "execution": {
            "results": [{"text": "2", "is_main_result": True}],
            "logs": {"stdout": [], "stderr": []},
            "error": None,
            "execution_count": 1,
        },
    }


def test_every_bad_line_kind_is_quarantined_with_its_reason(tmp_path: Path) -> None:
    good = json.dumps(_good_line())
    wrong_type = dict(_good_line(), code=5)
    missing = {k: v for k, v in _good_line().items() if k != "execution"}
    bad_stdout = dict(_good_line(), execution={"logs": {"stdout": [1]}})
    bad_html = dict(_good_line(), execution={"results": [{"text": "2", "html": 5}]})
    lines = [
        good.encode(),
        good[:-7].encode(),
        b"{'single': 'quotes'}",
        json.dumps(wrong_type).encode(),
        json.dumps(missing).encode(),
        json.dumps(bad_stdout).encode(),
        b"\xff\xfe\x00\x81garbage",
        b"\x00\x01\x02\x03" * 8,
        ("{" + " " * 300_000 + "}").encode(),
        b"[1, 2]",
        b"[" * 100_000 + b"]" * 100_000,  # 200 KB, under max_line_bytes: nested too deep
        json.dumps(bad_html).encode(),
        good.replace('"duration_ms": 0.5', '"duration_ms": NaN').encode(),
        good.replace('"duration_ms": 0.5', '"duration_ms": 1e999').encode(),
        json.dumps(dict(_good_line(), duration_ms=-1)).encode(),
        json.dumps(dict(_good_line(), code="café ☃"), ensure_ascii=False).encode()[:-12],
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    q = quarantine.Quarantine()
    records = list(parse_records(path, q, max_line_bytes=250_000))
    records += list(parse_records(tmp_path / "empty.jsonl", q))
    assert [r.id for r in records] == ["a"]
    assert q.summary() == {
        "binary_garbage": 1,
        "empty_file": 1,
        "invalid_json": 3,
        "invalid_utf8": 1,
        "missing_field": 1,
        "out_of_range": 1,
        "oversized_line": 1,
        "too_deep": 1,
        "truncated_json": 2,
        "wrong_type": 4,
    }
    q.write(tmp_path / "q.jsonl")
    written = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert {w["line"] for w in written if w["source"] == str(path)} == set(range(2, len(lines) + 1))
    details = " | ".join(w["detail"] for w in written)
    for detail in (
        "$.code: expected string, got integer",
        "$.execution.results[0].html: expected string or null, got integer",
        "$.execution.logs.stdout[0]: expected string, got integer",
        "$.duration_ms: must be >= 0, got -1",
        "$.results: missing (a record holds either `execution`",
        "NaN is not JSON",
    ):
        assert detail in details, details
    with pytest.raises(RecordError, match=r"\$.duration_ms: must be >= 0"):
        record_from_json(dict(_good_line(), duration_ms=-0.5))


def _cut_lines() -> list[bytes]:
    """A record with escapes, literals, numbers and non-ASCII text, as the writer writes it."""
    line = dict(
        _good_line(),
        code='print("tab\\t, quote \\"")\nx = [True, None, -0.5e-3]',
        expected_output="café ☃ \\u00e9",
        sandbox={"ok": True, "none": None, "no": False, "n": 0.0, "big": 12e30},
    )
    return [json.dumps(line).encode(), json.dumps(line, ensure_ascii=False).encode()]


def test_a_line_cut_anywhere_is_truncated_and_a_broken_one_invalid(tmp_path: Path) -> None:
    cuts = [raw[:k] for raw in _cut_lines() for k in range(1, len(raw))]
    path = tmp_path / "cuts.jsonl"
    path.write_bytes(b"\n".join(cuts) + b"\n")
    q = quarantine.Quarantine()
    assert list(parse_records(path, q)) == []
    assert q.summary() == {"truncated_json": len(cuts)}, [
        (e["excerpt"][-20:], e["detail"]) for e in q.entries if e["reason"] != "truncated_json"
    ][:5]
    for broken in ['{"a": tx', '{"a": 1 2', '{"a": 1}}', "[1,]", '{"a": 1,}', '{"a" 1', "{'a': 1"]:
        assert not jsonl.looks_truncated(broken), broken


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(value=st.dictionaries(st.text(max_size=5), _json_values, min_size=1, max_size=3))
def test_every_prefix_of_a_json_object_looks_truncated(value: dict) -> None:
    text = json.dumps(value, ensure_ascii=False)
    assert all(jsonl.looks_truncated(text[:k]) for k in range(1, len(text)))


def test_an_oversized_line_is_never_held_whole(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"code": "' + b"x" * (24 << 20) + b'"}\n')
        f.write(json.dumps(_good_line()).encode() + b"\n")
    q = quarantine.Quarantine()
    tracemalloc.start()
    records = list(parse_records(path, q, max_line_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r.id for r in records] == ["a"] and q.summary() == {"oversized_line": 1}
    assert q.entries[0]["detail"] == f"{(24 << 20) + 12} bytes > max_line_bytes=1048576"
    assert peak < 4 << 20, f"reading a 24 MB line peaked at {peak / 2**20:.1f} MB"


@pytest.mark.parametrize(
    "code, language",
    [
        ("def f(x):\n    return [y for y in x]\n", "python"),
        ("SELECT a, count(*) FROM t JOIN u ON t.id = u.id GROUP BY a;", "sql"),
        ("const f = (x) => x + 1;\nconsole.log(f(2));", "javascript"),
    ],
)
def test_language_detection_and_features(code: str, language: str) -> None:
    assert features.detect_language(code) == language
    feats = features.code_features(code, language)
    want = {
        "python": ("functions", "comprehensions"),
        "sql": ("sql_joins", "sql_aggregates", "sql_group_by"),
        "javascript": ("functions",),
    }[language]
    assert all(feats[k] >= 1 for k in want), feats


def test_hosted_e2b_without_a_key_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(
        ValueError, match=r"collect.use_e2b=true needs an E2B API key in \$E2B_API_KEY"
    ):
        collector.collect(
            tmp_path / "x.jsonl", ["sqlite_statements"], 1, sandbox.Limits(), use_e2b=True
        )
