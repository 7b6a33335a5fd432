"""`python -m capibara_exp.launch.t5x_main T5X_FLAGS`: T5X's own train script (the module
t5x.train, run as __main__ as `python -m t5x.train` runs it), with capibara-exp's process
set-up first: TensorFlow's and absl's notices off unless verbose, XLA compiles shown when
they last. engine=t5x runs this; the flags are t5x.train's."""

from __future__ import annotations

import os
import runpy
import sys

from capibara_exp import environment, phases

VERBOSE_ENV = "CAPIBARA_VERBOSE"


RUN_LOG_ENV = "CAPIBARA_RUN_LOG"


def main() -> None:
    verbose = os.environ.get(VERBOSE_ENV) == "1"
    environment.prepare(verbose)
    with phases.phase("importing T5X, TensorFlow, JAX and SeqIO"):
        environment.import_tensorflow(verbose)
        import t5x  # noqa: F401 (the package, not t5x.train: runpy runs that as __main__)
    chosen = any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:])
    if os.environ.get(RUN_LOG_ENV):
        # T5X's Python log (absl: each step, seqio's advice, orbax's files) goes to the run
        # log at INFO; the console shows it too only when verbose, else fatal lines only.
        _absl_to_file(os.environ[RUN_LOG_ENV])
        sys.argv += [] if chosen else ["--verbosity=0"]
        sys.argv += ["--alsologtostderr"] if verbose else []
    elif not verbose and not chosen:
        # absl's level for T5X's own logging: fatal only (T5X logs each step at INFO and
        # seqio warns about uncached tasks); capibara-exp shows the progress instead.
        sys.argv.append("--verbosity=-3")
    phases.show_compiles()
    sys.argv[0] = "t5x.train"
    runpy.run_module("t5x.train", run_name="__main__", alter_sys=True)


def _absl_to_file(path: str) -> None:
    """absl's handler (which app.run puts on the root logger) writes to `path`; records at
    its stderr threshold (fatal) still reach the console too."""
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler().python_handler
    handler.stream = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)


if __name__ == "__main__":
    main()
