"""E2B execution logs: sandbox, collector on real snippets, parser and its quarantine."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from capibara_exp.data import collector, features, quarantine, sandbox, secrets, snippets
from capibara_exp.data.e2b_records import parse_records, write_records

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
    lines = [
        good.encode(),
        good[:-7].encode(),
        b"{'single': 'quotes'}",
        json.dumps(wrong_type).encode(),
        json.dumps(missing).encode(),
        json.dumps(bad_stdout).encode(),
        b"\xff\xfe\x00\x81garbage",
        b"\x00\x01\x02\x03" * 8,
        ("{" + " " * 5000 + "}").encode(),
        b"[1, 2]",
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    q = quarantine.Quarantine()
    records = list(parse_records(path, q, max_line_bytes=4096))
    records += list(parse_records(tmp_path / "empty.jsonl", q))
    assert [r.id for r in records] == ["a"]
    assert q.summary() == {
        "binary_garbage": 2,
        "empty_file": 1,
        "invalid_json": 1,
        "missing_field": 1,
        "oversized_line": 1,
        "truncated_json": 1,
        "wrong_type": 3,
    }
    q.write(tmp_path / "q.jsonl")
    written = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert {w["line"] for w in written if w["source"] == str(path)} == set(range(2, 11))
    assert any("code must be str" in w["detail"] for w in written)


def test_secret_scrubbing_recall_on_a_seeded_set() -> None:
    samples = secrets.seeded_secrets(seed=1234, n=1300)
    assert {kind for _, _, kind in samples} == set(secrets._CONTEXTS)
    assert secrets.recall(samples) >= 0.99
    missed = [t for t, s, _ in samples if s in secrets.scrub(t)[0]]
    assert not missed, missed[:3]


def test_scrubbing_leaves_ordinary_code_alone() -> None:
    code = (
        "for token in tokens:\n    print(token)\npassword = input()\nkey = d['token']\n"
        "api_key = os.environ['API_KEY']\nSELECT count(*) FROM users WHERE id = 3;\n"
    )
    assert secrets.scrub(code) == (code, {})


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
