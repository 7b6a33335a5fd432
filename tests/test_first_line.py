"""Every console script says what it is before it imports anything heavy: its first line,
`<script>: starting ...`, comes before the first import of JAX, TensorFlow, SeqIO, Flax,
matplotlib or the E2B SDK, in the order the process wrote them.

Each script runs a cheap invocation that goes on to import a heavy library, under
`python -X importtime`, which writes a line to stderr as each import ends: stderr shows the
first line and the imports in the order they happened (no clock is read). The process is
stopped at the first heavy import; one that never reaches one fails the test (the order
would be untested).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(jax|jaxlib|tensorflow|seqio|flax|"
                   r"matplotlib|optax|orbax|t5x|torch|transformers|e2b)(\.\S+)?\s*$")
IMPORT_LINE = re.compile(r"^import time:")

# script -> its cheap invocation ({tmp}: the test's directory, with a run dir `a`, a
# metrics file in RUN/, a prompts file p.txt).
INVOCATIONS = {
    "capibara-exp": ["debug=fast", "data_dir={tmp}/data", "model_dir={tmp}/run"],
    "capibara-exp-data": ["data_dir={tmp}/data"],
    "capibara-exp-merge": ["runs=[{tmp}/a]", "out={tmp}/merged"],
    "capibara-exp-meta": ["meta_consensus=lr_trio", "out={tmp}/meta"],
    "capibara-exp-tune-mesh": [],
    "capibara-exp-plot": ["{tmp}/RUN", "--out", "{tmp}/curves.png"],
    "capibara-exp-lora": ["export", "run_dir={tmp}/a", "out={tmp}/exported"],
    "capibara-exp-convert": ["export", "checkpoint={tmp}/a", "out={tmp}/hf"],
    "capibara-exp-generate": ["checkpoint={tmp}/a", "prompts={tmp}/p.txt", "out={tmp}/o.jsonl"],
}


def scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: name -> module:function."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_every_console_script_has_an_invocation_here() -> None:
    assert sorted(scripts()) == sorted(INVOCATIONS)


def first_lines(script: str, args: list[str], cwd: Path) -> tuple[list[str], str | None]:
    """The script's own stderr lines before its first heavy import, and that import (None
    if it ended without one)."""
    module, function = scripts()[script].split(":")
    program = (f"import sys; sys.argv[0] = {script!r}\n"
               f"from {module} import {function}\n{function}()\n")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", program, *args],
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    own: list[str] = []
    heavy = None
    try:
        for line in proc.stderr:
            if HEAVY.match(line):
                heavy = line.split("|")[-1].strip()
                break
            if not IMPORT_LINE.match(line) and line.strip():
                own.append(line.rstrip("\n"))
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()
    return own, heavy


@pytest.mark.entry
@pytest.mark.parametrize("script", sorted(INVOCATIONS))
def test_the_first_line_comes_before_any_heavy_import(script: str, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "metrics.jsonl").write_text(
        '{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "split": "train", "loss": 1.5}\n')
    (tmp_path / "p.txt").write_text("hello\n")
    args = [a.format(tmp=tmp_path) for a in INVOCATIONS[script]]
    own, heavy = first_lines(script, args, tmp_path)
    assert heavy is not None, f"{script} {args} imported nothing heavy: {own}"
    assert own and own[0].startswith(f"{script}: starting"), (heavy, own)
