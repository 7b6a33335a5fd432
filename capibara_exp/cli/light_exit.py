"""A config command's end without the interpreter's teardown.

`capibara-exp --help`, `--cfg job` and a command line refused before Hydra's app starts
load Hydra, OmegaConf and the project's composing code, print, and end. Python's own end
then frees every module and object one by one, some 25-35 ms on this machine (as long as
a tenth of the command), which nothing of these commands needs: they start no thread,
leave no file open, and register no exit handler but logging's (tests/test_cli.py checks
that). Once such a command is done, its output is flushed, logging is shut down as at
exit, and the process ends with the same status (os._exit). Anything else (a run, a sweep,
Hydra's own app, a flush that fails such as a closed pipe) ends as Python ends it.
"""

from __future__ import annotations

import logging
import os
import sys

_light = [False]


def light(yes: bool) -> None:
    """Whether the command running may end without the teardown (see the module's doc)."""
    _light[0] = yes


def end(code: object, console: bool) -> None:
    """End a light command now with exit status `code` (SystemExit's: None is 0) where
    `console` says this is a console process's own call (main() reading its argv from the
    command line); returns (and Python ends as usual) for a call with arguments (a caller
    that goes on: tests), a command that is not light, or output that cannot be flushed."""
    if not (console and _light[0]) or not (code is None or isinstance(code, int)):
        return
    try:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a closed pipe or stream: Python's own exit reports it
        return
    logging.shutdown()  # the exit handler logging registers, run as at exit
    os._exit(code or 0)
