"""Prompts in (a text file, a JSONL file, a seqio task's inputs) and generations out (JSONL
beside a record of what made them), for capibara-exp-generate and the infer eval."""

from __future__ import annotations

import json
from pathlib import Path

from capibara_exp.base.errors import ConfigError

JSONL_KEYS = ("prompt", "inputs", "text")  # the first one a JSONL line has is its prompt


def read_text(path: Path) -> list[str]:
    """One prompt per non-empty line; a literal backslash-n inside a line is a newline."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.replace("\\n", "\n") for line in lines if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """One object per non-empty line with a prompt under one of JSONL_KEYS."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"prompts={path}:{number}: not JSON ({err})") from None
        key = next((k for k in JSONL_KEYS if isinstance(obj, dict) and k in obj), None)
        if key is None or not isinstance(obj[key], str):
            raise ConfigError(f"prompts={path}:{number}: no string under "
                              f"{' / '.join(JSONL_KEYS)}")
        out.append({**obj, "prompt": obj[key]})
    return out


def read_file(path: str | Path) -> list[dict]:
    """Prompt records ({'prompt': text, ...}) of a .txt or .jsonl file; at least one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts={path}: no such file")
    if path.suffix == ".jsonl":
        records = read_jsonl(path)
    elif path.suffix == ".txt":
        records = [{"prompt": p} for p in read_text(path)]
    else:
        raise ConfigError(f"prompts={path}: expected a .txt (one prompt a line) or .jsonl file")
    if not records:
        raise ConfigError(f"prompts={path}: no prompts in it (empty file)")
    return records


def from_task(task: str, split: str, limit: int | None) -> list[dict]:
    """The 'inputs' of a registered seqio task's split (its preprocessors applied)."""
    import seqio

    from capibara_exp.data import routing_tasks, tasks  # noqa: F401  registers the tasks

    tasks.register()
    try:
        source = seqio.get_mixture_or_task(task)
    except ValueError:
        raise ConfigError(f"task={task}: no such seqio task or mixture") from None
    if "inputs" not in source.output_features:
        raise ConfigError(f"task={task}: has no 'inputs' feature to prompt with "
                          f"(features: {', '.join(source.output_features)})")
    if split not in source.splits:
        raise ConfigError(f"split={split}: task {task} has {', '.join(source.splits)}")
    ds = source.get_dataset(None, split=split, shuffle=False, use_cached=False)
    vocab = source.output_features["inputs"].vocabulary
    out = []
    for i, ex in enumerate(ds.as_numpy_iterator()):
        if limit is not None and i >= limit:
            break
        record = {"prompt": vocab.decode([int(t) for t in ex["inputs"] if t > 1])}
        if "targets_pretokenized" in ex:
            record["target"] = ex["targets_pretokenized"].decode("utf-8")
        out.append(record)
    if not out:
        raise ConfigError(f"task={task} split={split}: no examples")
    return out
