"""Console script `capibara-exp-lora`: LoRA utilities.

    capibara-exp-lora export run_dir=RUN out=DIR [step=N]

merges the adapters of a LoRA run (its latest checkpoint, or checkpoint_N) into the base
model it was trained on and writes a normal checkpoint in T5X's layout, DIR/checkpoint_<N>,
that the base experiment restores under engine=local and engine=t5x; prints its path.
"""

from __future__ import annotations

import sys

from capibara_exp.base import environment, phases
from capibara_exp.cli import guards
from capibara_exp.cli.common import fail, user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-lora"
# command -> (required keys, optional keys)
COMMANDS = {"export": (("run_dir", "out"), ("step",))}
USAGE = f"usage: {PROG} export run_dir=RUN out=DIR [step=N]"


def parse(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(command, {key: value}) from `command key=value ...`; a user error names the problem."""
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command"
        fail(PROG, f"{given}; {USAGE}")
    command, (required, optional) = argv[0], COMMANDS[argv[0]]
    keys: dict[str, str] = {}
    for arg in argv[1:]:
        key, eq, value = arg.partition("=")
        if not eq or not value:
            fail(PROG, f"{arg!r} is not key=value; {USAGE}")
        if key not in required + optional:
            fail(PROG, f"unknown key {key!r} for {command} "
                       f"(keys: {', '.join(required + optional)})")
        keys[key] = value
    missing = [k for k in required if k not in keys]
    if missing:
        fail(PROG, f"missing {', '.join(f'{k}=...' for k in missing)}; {USAGE}")
    return command, keys


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    _, keys = parse(argv)
    step = keys.get("step")
    if step is not None and not step.isdigit():
        fail(PROG, f"step={step}: expected a checkpoint step (an integer)")
    with user_errors(PROG):
        run_dir = guards.existing_input("run_dir", keys["run_dir"])
        guards.new_output("out", keys["out"], {"run_dir": run_dir})
    phases.starting(PROG)
    environment.prepare()  # quiet native logs and the platform choice, before JAX loads
    with phases.importing():
        environment.import_tensorflow()  # (gin's config imports seqio) without its notices
        with user_errors(PROG):
            from capibara_exp.runtime.lora import export
    with user_errors(PROG):
        path = export.export_run(keys["run_dir"], keys["out"], None if step is None else int(step))
    print(path)


if __name__ == "__main__":
    main()
