"""Sandbox runner: execute SQL cells against a sqlite3 database, one JSON line per cell.

Reads {"cells": [{"id", "code", "reset"}], "timeout_s"} on stdin. A `reset` cell opens a
fresh database file in the working dir; each statement's rows are a result, the last
statement's rows are the main result.
"""

import json
import os
import sqlite3
import sys
import time
import traceback

from cell_protocol import MAX_TEXT, CellClock, emit

MAX_ROWS = 20


def _statements(script):
    buf = ""
    for piece in script.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""
    if buf.strip(" \n\t;"):
        yield buf.strip()[:-1]  # an unterminated last statement, without the ';' added here


def _table(cursor):
    names = [d[0] for d in cursor.description]
    rows = cursor.fetchmany(MAX_ROWS)
    lines = [" | ".join(names)] + [" | ".join(repr(v) for v in row) for row in rows]
    return "\n".join(lines)[:MAX_TEXT]


def _run(conn, code, deadline):
    conn.set_progress_handler(lambda: int(time.perf_counter() > deadline), 1000)
    results = []
    for statement in _statements(code):
        cursor = conn.execute(statement)
        if cursor.description:
            results.append({"text": _table(cursor), "is_main_result": False})
    conn.commit()
    if results:
        results[-1]["is_main_result"] = True
    return results


def main():
    proto = sys.stdout
    request = json.load(sys.stdin)
    timeout_s = float(request["timeout_s"])
    conn, count, n_db = None, 0, 0
    for cell in request["cells"]:
        if conn is None or cell.get("reset"):
            if conn is not None:
                conn.close()
            n_db += 1
            conn, count = sqlite3.connect(os.path.join(os.getcwd(), f"db{n_db}.sqlite3")), 0
        count += 1
        results, error = [], None
        clock = CellClock()
        try:
            results = _run(conn, cell["code"], time.perf_counter() + timeout_s)
        except Exception as exc:
            error = {
                "name": type(exc).__name__,
                "value": str(exc)[:MAX_TEXT],
                "traceback": "".join(traceback.format_exception_only(type(exc), exc)),
            }
        emit(proto, cell["id"], clock, count, results, "", "", error)


if __name__ == "__main__":
    main()
