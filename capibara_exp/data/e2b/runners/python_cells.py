"""Sandbox runner: execute Python cells like a notebook kernel, one JSON line per cell.

Reads {"cells": [{"id", "code", "reset"}], "timeout_s"} on stdin. Every top-level
expression is shown as the REPL shows it (so doctest output compares); the value of a
cell's last expression is its main result, as in E2B's `Execution.results`.
"""

import ast
import contextlib
import importlib
import io
import json
import os
import signal
import sys
import traceback

from cell_protocol import MAX_TEXT, CellClock, emit


def _on_alarm(signum, frame):
    raise TimeoutError("cell exceeded its time limit")


def _run(code, ns):
    results = []
    tree = ast.parse(code, "<cell>")
    for i, node in enumerate(tree.body):
        last = i == len(tree.body) - 1
        if isinstance(node, ast.Expr) and last:
            value = eval(compile(ast.Expression(node.value), "<cell>", "eval"), ns)
            if value is not None:
                results.append({"text": repr(value)[:MAX_TEXT], "is_main_result": True})
        else:  # "single" mode shows intermediate expression values on stdout, as the REPL does
            mode = "single" if isinstance(node, ast.Expr) else "exec"
            mod = ast.Interactive([node]) if mode == "single" else ast.Module([node], [])
            exec(compile(mod, "<cell>", mode), ns)
    return results


def _error(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
        tb = tb.tb_next  # drop this runner's frames: the traceback starts in the cell
    lines = traceback.format_exception(type(exc), exc, tb)
    return {
        "name": type(exc).__name__,
        "value": str(exc)[:MAX_TEXT],
        "traceback": "".join(lines)[:MAX_TEXT],
    }


def _namespace(cell):
    """A fresh namespace; a doctest's cells see its module's globals, as doctest gives them."""
    ns = {"__name__": "__main__"}
    try:
        if cell.get("module"):
            ns = dict(vars(importlib.import_module(cell["module"])))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(cell.get("setup") or "", ns)
    except Exception:  # the cell then fails with the NameError a missing global gives
        pass
    return ns


def main():
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    request = json.load(sys.stdin)
    timeout_s = float(request["timeout_s"])
    signal.signal(signal.SIGALRM, _on_alarm)
    ns, count = None, 0
    for cell in request["cells"]:
        if ns is None or cell.get("reset"):
            ns, count = _namespace(cell), 0
        count += 1
        out, err = io.StringIO(), io.StringIO()
        results, error = [], None
        clock = CellClock()
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                results = _run(cell["code"], ns)
        except BaseException as exc:  # the cell's failure is data, SystemExit included
            error = _error(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        emit(proto, cell["id"], clock, count, results, out.getvalue(), err.getvalue(), error)


if __name__ == "__main__":
    main()
