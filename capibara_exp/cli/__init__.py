"""The console scripts, one module each, on a common shell (common.py, shell.py).

capibara-exp (main.py), capibara-exp-data (data.py), capibara-exp-merge (merge.py),
capibara-exp-tune-mesh (tune_mesh.py), capibara-exp-plot (plot.py). Each composes its
config and calls one library function; only Hydra, OmegaConf and the pure gin bridge are
imported before that, so `--help` and `--cfg job` answer without loading JAX or SeqIO.

Imported as a console script, this package handles SIGTERM and SIGINT at once (before the
imports of a second or more that precede `main`): status 75 and one line; shell.py's
handler takes over when `main` starts.
"""

import os as _os
import signal as _signal
import sys as _sys


def _starting(signum: int, frame: object) -> None:
    prog = _os.path.basename(_sys.argv[0]) if _sys.argv else "capibara-exp"
    print(f"{prog}: stopped by {_signal.Signals(signum).name} while starting: nothing was "
          "written; run the same command again", file=_sys.stderr, flush=True)
    _os._exit(75)  # the interpreter is mid-import: leave without unwinding it


def _as_console_script() -> bool:
    name = _os.path.basename(_sys.argv[0]) if _sys.argv else ""
    return name.startswith("capibara-exp") or name == "-m"


if _as_console_script():
    for _sig in (_signal.SIGTERM, _signal.SIGINT):
        _signal.signal(_sig, _starting)
