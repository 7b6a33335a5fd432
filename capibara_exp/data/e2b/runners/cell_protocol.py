"""The runners' output protocol: one JSON line per executed cell, in E2B's Execution fields.

Imported by the runner scripts beside it (a script's own directory is on its sys.path).
"""

import datetime
import json
import time

MAX_TEXT = 20000


class CellClock:
    """When a cell started (ISO, UTC) and how long it ran."""

    def __init__(self):
        self.started = datetime.datetime.now(datetime.UTC).isoformat()
        self.t0 = time.perf_counter()

    def ms(self):
        return (time.perf_counter() - self.t0) * 1e3


def emit(stream, cell_id, clock, count, results, stdout, stderr, error):
    """Write one cell's record: results, stdout/stderr text cut into lines, error, timing."""
    record = {
        "id": cell_id,
        "results": results,
        "stdout": stdout[:MAX_TEXT].splitlines(True),
        "stderr": stderr[:MAX_TEXT].splitlines(True),
        "error": error,
        "execution_count": count,
        "duration_ms": clock.ms(),
        "started_at": clock.started,
    }
    stream.write(json.dumps(record) + "\n")
    stream.flush()
