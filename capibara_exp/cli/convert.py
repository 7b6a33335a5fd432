"""Console script `capibara-exp-convert`: models in and out in Hugging Face's format, and a
SentencePiece vocabulary for the project's corpus.

    capibara-exp-convert import hf_dir=DIR out=DIR [name=ENTRY] [scan_layers=true]
                                [dtype=float32|bfloat16]
    capibara-exp-convert export checkpoint=PATH out=DIR [model=ENTRY] [config_dir=DIR]
                                [family=NAME] [dtype=float32|bfloat16] [max_shard_gb=5]
    capibara-exp-convert sentencepiece out=FILE.model [vocab_size=8000]
                                [model_type=unigram|bpe] [data_dir=DIR]

import reads a local model directory (config.json, *.safetensors with or without an index,
tokenizer files; never a hub) into OUT/checkpoint_0 (T5X's layout), OUT/conf/model/ENTRY.yaml
and OUT/tokenizer/, and prints the command that trains it. export writes a checkpoint (a run
dir's latest, or a checkpoint_<step> dir) as a Hugging Face model directory. sentencepiece
trains a subword vocabulary on the corpus the default experiment reads and prints its tokens
per byte. Families: Llama 3.x, Mistral, Qwen2.5, Qwen3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE
(docs/models.md). A refused command writes nothing: one line, exit 2.
"""

from __future__ import annotations

import json
import sys

from capibara_exp.base import environment, model_facts, phases
from capibara_exp.cli import guards
from capibara_exp.cli.common import fail, user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-convert"
# command -> (required keys, optional keys)
COMMANDS = {
    "import": (("hf_dir", "out"), ("name", "scan_layers", "dtype")),
    "export": (("checkpoint", "out"), ("model", "config_dir", "family", "dtype",
                                       "max_shard_gb")),
    "sentencepiece": (("out",), ("vocab_size", "model_type", "data_dir")),
}
USAGE = f"usage: {PROG} import|export|sentencepiece key=value ... ({PROG} --help)"


def parse(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(command, {key: value}) from `command key=value ...`; a user error names the problem."""
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command"
        fail(PROG, f"{given}; {USAGE}")
    command, (required, optional) = argv[0], COMMANDS[argv[0]]
    keys: dict[str, str] = {}
    for arg in argv[1:]:
        key, eq, value = arg.partition("=")
        if not eq or not value.strip():
            fail(PROG, f"{arg!r} is not key=value with a value; {USAGE}")
        if key not in required + optional:
            fail(PROG, f"unknown key {key!r} for {command} "
                       f"(keys: {', '.join(required + optional)})")
        keys[key] = value
    missing = [k for k in required if k not in keys]
    if missing:
        fail(PROG, f"missing {', '.join(f'{k}=...' for k in missing)} for {command}; {USAGE}")
    return command, keys


def _typed(keys: dict[str, str]) -> dict:
    """Values with their types: booleans, sizes, dtypes."""
    out: dict = dict(keys)
    if "scan_layers" in keys:
        if keys["scan_layers"] not in ("true", "false"):
            fail(PROG, f"scan_layers={keys['scan_layers']}: expected true or false")
        out["scan_layers"] = keys["scan_layers"] == "true"
    for key, cast in (("vocab_size", int), ("max_shard_gb", float)):
        if key in keys:
            try:
                out[key] = cast(keys[key])
            except ValueError:
                fail(PROG, f"{key}={keys[key]}: expected a number")
            if out[key] <= 0:
                fail(PROG, f"{key}={keys[key]}: must be positive")
    if keys.get("dtype") not in (None, *model_facts.DTYPES):
        fail(PROG, f"dtype={keys['dtype']}: expected {' or '.join(model_facts.DTYPES)}")
    return out


def run(command: str, keys: dict) -> dict:
    if command == "sentencepiece":
        from capibara_exp.data import sentencepiece_model

        # the data dir capibara-exp reads by default (./data), where the corpus is built
        return sentencepiece_model.train(keys["out"], keys.get("data_dir") or "data",
                                         keys.get("vocab_size", 8000),
                                         keys.get("model_type", "unigram"))
    if command == "import":
        from capibara_exp.convert import hf_import

        record = hf_import.import_model(keys["hf_dir"], keys["out"], keys.get("name"),
                                        keys.get("scan_layers", False), keys.get("dtype"))
        out = keys["out"]
        return {**{k: record[k] for k in ("architecture", "parameters", "dtypes",
                                          "vocabulary", "checkpoint")},
                "train_with": f"capibara-exp --config-dir={out}/conf "
                              f"model={record['model_entry']} "
                              f"checkpoint.initial_checkpoint={record['checkpoint']}"}
    from capibara_exp.convert import hf_export

    shard = int(keys.get("max_shard_gb", 5) * 2**30)
    return hf_export.export_model(keys["checkpoint"], keys["out"], keys.get("model"),
                                  keys.get("config_dir"), keys.get("family"),
                                  keys.get("dtype"), shard)


def check_paths(command: str, keys: dict[str, str]) -> None:
    """Inputs exist; the output is new (or an empty dir) and overlaps no input."""
    inputs = {k: guards.existing_input(k, keys[k])
              for k in ("hf_dir", "checkpoint", "config_dir") if k in keys}
    if command == "sentencepiece":
        guards.new_file("out", keys["out"], inputs)
    else:
        guards.new_output("out", keys["out"], inputs)


def preflight(command: str, typed: dict) -> None:
    """What can be refused from small files and the settings alone, before the first line
    and the heavy imports: a model directory's config.json (an architecture this project
    does not implement, options it does not support), a vocabulary's settings."""
    from pathlib import Path

    if command == "import":
        from capibara_exp.convert import families

        hf_dir = Path(typed["hf_dir"]).expanduser().absolute()
        families.model_keys(families.read_config(hf_dir), str(hf_dir / "config.json"))
    elif command == "sentencepiece":
        from capibara_exp.data import sentencepiece_model

        sentencepiece_model.check_settings(typed["out"], typed.get("vocab_size", 8000),
                                           typed.get("model_type", "unigram"))


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    command, keys = parse(argv)
    typed = _typed(keys)
    with user_errors(PROG):
        check_paths(command, keys)
        preflight(command, typed)
    phases.starting(PROG)
    environment.prepare()  # quiet native logs and the platform choice, before JAX loads
    with phases.importing("TensorFlow"):
        environment.import_tensorflow()  # (seqio, via the data package) without its notices
    with user_errors(PROG):
        summary = run(command, typed)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
