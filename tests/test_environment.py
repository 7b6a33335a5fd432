"""The process set-up the entry points run first, and the progress of long phases."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from capibara_exp.base import phases


def test_importing_capibara_exp_changes_no_environment() -> None:
    probe = ("import os; before = dict(os.environ); import capibara_exp, capibara_exp.cli.main, "
             "capibara_exp.experiment; print(sorted(set(os.environ.items()) ^ "
             "set(before.items())))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TF_"))}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("verbose", [False, True])
def test_tensorflow_loads_quietly_unless_verbose(verbose: bool) -> None:
    """TensorFlow's shared libraries print INFO lines while they load (CUDA lookups, absl's
    preamble), before any log level applies: prepare + import_tensorflow drop exactly those;
    a line written to stderr during the import still gets through."""
    probe = ("import os, sys\nfrom capibara_exp.base import environment\n"
             f"environment.prepare({verbose})\n"
             "import builtins\nreal = builtins.__import__\n"
             "def noisy(name, *a, **k):\n"
             "    if name == 'tensorflow' and 'tensorflow' not in sys.modules:\n"
             "        os.write(2, b'a line of its own\\n')\n"
             "    return real(name, *a, **k)\n"
             "builtins.__import__ = noisy\n"
             f"environment.import_tensorflow({verbose})\n"
             "import tensorflow as tf\nprint(int(tf.constant(2) + 1))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_", "GRPC_"))}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
    assert "a line of its own" in out.stderr
    noise = [line for line in out.stderr.splitlines()
             if "absl::InitializeLog" in line or "cuda" in line.lower() or "oneDNN" in line]
    if verbose:
        assert noise, out.stderr  # the lines exist: quiet mode is what removes them
    else:
        assert not noise, out.stderr


def test_a_long_phase_says_what_it_does_and_a_short_one_says_nothing(monkeypatch) -> None:
    monkeypatch.setattr(phases, "SHOW_AFTER_S", 0.05)
    monkeypatch.setattr(phases, "NOTE_EVERY_S", 0.05)
    # the program named by the last script run in this process (tests run several in it)
    monkeypatch.setattr(phases, "PROG", "capibara-exp")
    quick, slow = io.StringIO(), io.StringIO()
    with phases.phase("a quick thing", quick):
        pass
    import time

    with phases.phase("building the data", slow):
        time.sleep(0.3)
    assert quick.getvalue() == ""
    text = slow.getvalue().splitlines()
    assert text[0] == "capibara-exp: building the data ..."
    assert any(line.endswith(" s") and "..." in line for line in text[1:-1])
    assert text[-1].startswith("capibara-exp: building the data: ")


def test_xla_compiles_are_phases_from_jax_compile_events(monkeypatch) -> None:
    """Each backend compile runs as a phase named after the program (JAX's compile events
    start and end it; the timing itself is the phase's, tested above)."""
    import jax
    import jax.numpy as jnp

    started, stopped = [], []

    class Recorded:
        def __init__(self, what: str, stream) -> None:
            started.append(what)

        def stop(self) -> None:
            stopped.append(started[-1])

    monkeypatch.setattr(phases, "_Ticker", Recorded)
    phases.show_compiles()
    jax.jit(lambda x: jnp.tanh(x) * 3.25 + 1)(jnp.ones(7)).block_until_ready()
    assert "compiling jit(<lambda>)" in started and started == stopped
