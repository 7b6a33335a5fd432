"""Console script `capibara-exp-generate`: text from any checkpoint.

    capibara-exp-generate checkpoint=PATH prompts=FILE.txt|FILE.jsonl out=OUT.jsonl
    capibara-exp-generate checkpoint=PATH task=SEQIO_TASK [split=validation] out=OUT.jsonl
        [method=greedy|sample|beam] [temperature=1.0] [top_k=0] [top_p=0.0] [num_beams=4]
        [alpha=0.6] [max_new_tokens=64] [stop=ID,ID] [stop_text=TEXT] [seed=0] [num_samples=1]
        [batch_size=8] [max_length=2048] [limit=N] [model=ENTRY] [config_dir=DIR] [dtype=...]

checkpoint: a run's model dir (its latest checkpoint), a checkpoint_<step> dir, a merge's, a
LoRA export's or an import's output. Writes OUT (one JSON object a prompt: the prompt, its
outputs with text, token ids and score) and OUT.record.json (checkpoint, model, decoding
settings, prompts' source, tokens/s). Decoding is T5X's (docs/generation.md). Exit 0 done;
2 a user error, one line, nothing written; 1 an internal failure; 75 stopped by
SIGTERM/SIGINT with the finished prompts kept (the same command resumes).
"""

from __future__ import annotations

import sys

from capibara_exp.base import environment, phases
from capibara_exp.base.errors import Preempted
from capibara_exp.cli.common import fail, user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-generate"
REQUIRED = ("checkpoint", "out")
OPTIONAL = ("prompts", "task", "split", "method", "temperature", "top_k", "top_p", "num_beams",
            "alpha", "max_new_tokens", "stop", "stop_text", "seed", "num_samples", "batch_size",
            "max_length", "limit", "model", "config_dir", "dtype")
INTS = ("top_k", "num_beams", "max_new_tokens", "seed", "num_samples", "batch_size",
        "max_length", "limit")
FLOATS = ("temperature", "top_p", "alpha")
USAGE = f"usage: {PROG} checkpoint=PATH prompts=FILE|task=NAME out=FILE.jsonl ... ({PROG} --help)"


def parse(argv: list[str]) -> dict:
    """{key: typed value} of `key=value ...`; a user error names the key."""
    keys: dict = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or not value.strip():
            fail(PROG, f"{arg!r} is not key=value with a value; {USAGE}")
        if key not in REQUIRED + OPTIONAL:
            fail(PROG, f"unknown key {key!r} (keys: {', '.join(REQUIRED + OPTIONAL)})")
        keys[key] = _typed(key, value)
    missing = [k for k in REQUIRED if k not in keys]
    if missing:
        fail(PROG, f"missing {', '.join(f'{k}=...' for k in missing)}; {USAGE}")
    if ("prompts" in keys) == ("task" in keys):
        fail(PROG, f"give prompts=FILE or task=NAME (one of them); {USAGE}")
    return keys


def _typed(key: str, value: str):
    try:
        if key in INTS:
            return int(value)
        if key in FLOATS:
            return float(value)
        if key == "stop":
            return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        fail(PROG, f"{key}={value}: expected {'numbers' if key == 'stop' else 'a number'}")
    return value


@console(PROG, lambda argv: "the checkpoint as it was; the finished prompts' outputs in out")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    keys = parse(argv)
    phases.starting(PROG)
    environment.prepare()
    with phases.importing():
        environment.import_tensorflow()
        from capibara_exp.generation import command

    with user_errors(PROG, ValueError):
        job = command.prepare(keys)
    try:
        summary = command.run(job, PROG)
    except Preempted as stop:
        print(stop, file=sys.stderr)
        raise
    print(f"{PROG}: wrote {summary['done']} prompts' outputs to {summary['out']} "
          f"({summary['tokens']} tokens, {summary['tokens_per_s']:.1f} tokens/s)")


if __name__ == "__main__":
    main()
