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


def main() -> None:
    verbose = os.environ.get(VERBOSE_ENV) == "1"
    environment.prepare(verbose)
    environment.import_tensorflow(verbose)
    if not verbose and not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
        # absl's level for T5X's own logging: fatal only (T5X logs each step at INFO and
        # seqio warns about uncached tasks); capibara-exp shows the progress instead.
        sys.argv.append("--verbosity=-3")
    phases.show_compiles()
    sys.argv[0] = "t5x.train"
    runpy.run_module("t5x.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
