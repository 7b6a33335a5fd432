"""The collector: execute real snippets and record them as E2B execution logs (JSONL).

Offline by default: cells run in the local sandbox (capibara_exp/data/sandbox.py). With
`use_e2b` and an E2B API key in the environment ($E2B_API_KEY, read by the SDK itself)
they run in E2B's hosted sandbox through `e2b_code_interpreter.Sandbox.run_code`; the key
is never read, logged or written by this module.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2b_code_interpreter.models import Execution, ExecutionError, Logs, Result

from capibara_exp.base.errors import ConfigError
from capibara_exp.data.e2b import processing, sandbox, snippets
from capibara_exp.data.e2b.records import ExecutionRecord, write_records

SOURCES: dict[str, Callable[[], Iterator[snippets.Snippet]]] = {
    "stdlib_doctests": snippets.stdlib_doctests,
    "numpy_doctests": snippets.numpy_doctests,
    "sqlite_statements": snippets.sqlite_statements,
    "markdown_javascript": snippets.markdown_javascript,
}
CELLS_PER_PROCESS = 48


def gather(
    sources: Iterable[str], max_per_source: int | None, limits: sandbox.Limits | None = None
) -> tuple[list[snippets.Snippet], dict]:
    """The snippets of the named sources in a fixed order (at most max_per_source each), and
    what was left out: JavaScript that node cannot parse (README fragments: `...`, shell
    lines, pseudo-code) is screened out before it runs; without node there is none."""
    out, stats = [], {}
    for name in sources:
        if name not in SOURCES:
            raise ConfigError(
                f"collect.sources: unknown source '{name}' (known: {', '.join(SOURCES)})"
            )
        found = SOURCES[name]()
        if name == "markdown_javascript":
            if sandbox.node_binary() is None:
                stats[name] = {"snippets": 0, "skipped": "node is not installed"}
                continue
            found = list(found)
            errors = sandbox.javascript_syntax_errors(
                {str(i): s.code for i, s in enumerate(found)}, limits or sandbox.Limits()
            )
            kept = [s for i, s in enumerate(found) if str(i) not in errors]
            stats[name] = {"syntax_errors_screened_out": len(found) - len(kept)}
            found = kept
        items = list(itertools.islice(found, max_per_source))
        stats[name] = {"snippets": len(items), **stats.get(name, {})}
        out += items
    return out, stats


def _record(snippet: snippets.Snippet, out: dict, meta: dict) -> ExecutionRecord:
    err = out.get("error")
    execution = Execution(
        results=[Result(**r) for r in out.get("results", [])],
        logs=Logs(stdout=out.get("stdout"), stderr=out.get("stderr")),
        error=ExecutionError(**err) if err else None,
        execution_count=out.get("execution_count"),
    )
    return ExecutionRecord(
        id=snippet.id,
        language=snippet.language,
        code=snippet.code,
        execution=execution,
        duration_ms=float(out.get("duration_ms") or 0.0),
        started_at=out.get("started_at") or "",
        sandbox=meta,
        source=snippet.source,
        expected_output=snippet.expected_output,
    )


def _run_batch(batch: list[snippets.Snippet], limits: sandbox.Limits) -> list[ExecutionRecord]:
    language = batch[0].language
    meta = sandbox.sandbox_metadata(language)
    outputs = sandbox.run_cells(language, [s.cell() for s in batch], limits)
    return [_record(s, o, meta) for s, o in zip(batch, outputs, strict=True)]


def _batches(items: list[snippets.Snippet]) -> list[list[snippets.Snippet]]:
    """Consecutive snippets of one language and module share a process (imports once)."""
    out: list[list[snippets.Snippet]] = []
    for _, group in itertools.groupby(items, key=lambda s: (s.language, s.module, s.setup)):
        group = list(group)
        out += [group[i : i + CELLS_PER_PROCESS] for i in range(0, len(group), CELLS_PER_PROCESS)]
    return out


def collect_local(
    items: list[snippets.Snippet], limits: sandbox.Limits, workers: int = 2
) -> list[ExecutionRecord]:
    """Execute every snippet in local sandboxes; records come back in snippet order."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = pool.map(lambda b: _run_batch(b, limits), _batches(items))
        return [r for batch in done for r in batch]


def collect_e2b(items: list[snippets.Snippet], timeout_s: float) -> list[ExecutionRecord]:
    """Execute every snippet in a hosted E2B sandbox (needs $E2B_API_KEY; not run in tests)."""
    from e2b_code_interpreter import Sandbox

    records = []
    with Sandbox.create() as sbx:
        meta = {"engine": "e2b", "template": "code-interpreter", "sandbox_id": sbx.sandbox_id}
        for s in items:
            # A fresh context per snippet, as the local sandbox resets per snippet; SQL has no
            # E2B kernel and runs through Python's sqlite3 inside the sandbox.
            started = datetime.datetime.now(datetime.UTC).isoformat()
            t0 = time.perf_counter()
            if s.language == "sql":
                execution = _e2b_sql(sbx, s)
            else:
                context = sbx.create_code_context(language=s.language)
                # Doctests see their module's globals locally; here a star import is the
                # nearest the hosted kernel offers.
                setup = "\n".join(
                    filter(None, [f"from {s.module} import *" if s.module else "", s.setup])
                )
                if setup:
                    sbx.run_code(setup, context=context, timeout=timeout_s)
                execution = sbx.run_code(s.code, context=context, timeout=timeout_s)
            records.append(
                ExecutionRecord(
                    id=s.id,
                    language=s.language,
                    code=s.code,
                    execution=execution,
                    duration_ms=(time.perf_counter() - t0) * 1e3,
                    started_at=started,
                    sandbox=meta,
                    source=s.source,
                    expected_output=s.expected_output,
                )
            )
    return records


def _e2b_sql(sbx, s: snippets.Snippet) -> Execution:
    """E2B has no SQL kernel: run the statements through Python's sqlite3 in the sandbox."""
    program = (
        "import sqlite3\nconn = sqlite3.connect(':memory:')\n"
        f"for _s in {s.code!r}.split(';'):\n"
        "    _r = conn.execute(_s).fetchall() if _s.strip() else None\n_r"
    )
    return sbx.run_code(program)


def collect(
    path: Path,
    sources: Iterable[str],
    max_per_source: int | None,
    limits: sandbox.Limits,
    use_e2b: bool = False,
) -> tuple[list[ExecutionRecord], dict]:
    """Execute the sources' snippets and write their execution log to `path` (JSONL),
    scrubbed: no secret a snippet holds or prints reaches the disk.

    Returns the scrubbed records and, per source, how many snippets ran and what was left
    out (and the secrets scrubbed, under `secrets_scrubbed`)."""
    if use_e2b and not os.environ.get("E2B_API_KEY"):
        raise ConfigError("collect.use_e2b=true needs an E2B API key in $E2B_API_KEY")
    items, stats = gather(sources, max_per_source, limits)
    if use_e2b:
        records = collect_e2b(items, limits.cell_timeout_s)
    else:
        records = collect_local(items, limits)
    found: Counter = Counter()
    clean = []
    for record in records:
        scrubbed, counts = processing.scrubbed_record(record)
        clean.append(scrubbed)
        found.update(counts)
    write_records(path, clean)
    return clean, {**stats, "secrets_scrubbed": dict(sorted(found.items()))}
