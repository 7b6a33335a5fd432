"""`python -m capibara_exp.launch.t5x_main T5X_FLAGS`: T5X's own train script (the module
t5x.train, run as __main__ as `python -m t5x.train` runs it), with capibara-exp's process
set-up first: TensorFlow's and absl's notices off unless verbose, XLA compiles shown when
they last; data a task reads that are not built end it with one line naming the command
that builds them, exit 2. engine=t5x runs this; the flags are t5x.train's."""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys

from capibara_exp.base import environment, phases
from capibara_exp.base.errors import NotBuilt

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
    _time_the_train_data()
    phases.show_compiles()
    logging.getLogger().addHandler(_T5XPhases())
    sys.argv[0] = "t5x.train"
    try:
        runpy.run_module("t5x.train", run_name="__main__", alter_sys=True)
    except NotBuilt as err:  # data a task reads not built: the one line naming the command
        line = str(err).splitlines()[0]  # without the call notes gin appends below it
        print(f"capibara_exp.launch.t5x_main: configuration error: {line}", file=sys.stderr,
              flush=True)
        sys.exit(2)


def _time_the_train_data() -> None:
    """Bind T5X's get_dataset_fn to the timed one (launch/t5x_data.py), unless the gin files
    or flags bind it themselves (theirs is kept, and the progress lines show no data wait)."""
    from capibara_exp.launch import t5x_data

    if not os.environ.get(t5x_data.WAIT_FILE_ENV):
        return
    given = [a for a in sys.argv[1:] if a.startswith(("--gin_bindings", "--gin."))]
    for arg in sys.argv[1:]:
        if arg.startswith("--gin_file="):
            with contextlib.suppress(OSError):
                given.append(open(arg.split("=", 1)[1]).read())  # noqa: SIM115
    if not any("get_dataset_fn" in text for text in given):
        sys.argv += [f"--gin_bindings={line}" for line in t5x_data.BINDINGS]


# What T5X's train.py logs as it enters a phase that can last, and the phase line for it
# (capibara-exp's words, as the local engine's); any later train.py record ends the phase.
T5X_PHASES = (
    ("Using seed for initialization", "T5X: building the data sets, initializing or "
                                      "restoring the model"),
    ("Saving checkpoint", "T5X: saving a checkpoint"),
    ("Saving emergency checkpoint", "T5X: saving a checkpoint"),
    ("Computing training evaluation metrics", "T5X: evaluating"),
    ("Running training eval before training", "T5X: evaluating"),
    ("Running inference eval", "T5X: running the inference evaluation"),
)


class _T5XPhases(logging.Handler):
    """Phase lines from T5X's own log records (train.py's INFO lines), which reach every
    root handler whatever is shown: T5X's silences get the local engine's phase lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.current: contextlib.ExitStack | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.filename != "train.py" or "t5x" not in record.pathname:
            return
        if self.current is not None:
            self.current.close()
            self.current = None
        message = record.getMessage()
        for start, what in T5X_PHASES:
            if message.startswith(start):
                self.current = contextlib.ExitStack()
                self.current.enter_context(phases.phase(what))
                return


def _absl_to_file(path: str) -> None:
    """absl's handler (which app.run puts on the root logger) writes to `path`; records at
    its stderr threshold (fatal) still reach the console too."""
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler().python_handler
    handler.stream = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)


if __name__ == "__main__":
    main()
