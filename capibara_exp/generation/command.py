"""What capibara-exp-generate does, with plain arguments: check everything first (nothing is
written for a refused command), then decode batch by batch with progress, then write the
outputs and their record; a SIGTERM/SIGINT keeps the finished prompts and the same command
resumes after them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from capibara_exp.base import atomic
from capibara_exp.base.errors import ConfigError, Preempted
from capibara_exp.generation import loading, prompts
from capibara_exp.runtime import decoding

SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(decoding.Sampling))


@dataclasses.dataclass
class Job:
    loaded: loading.Loaded
    records: list[dict]
    token_ids: list[list[int]]
    sampling: decoding.Sampling
    out: Path
    record: dict
    batch_size: int
    done: list[str]  # JSONL lines kept from a stopped run of the same command


def record_path(out: Path) -> Path:
    return out.with_name(out.name + ".record.json")


def _sampling(keys: dict) -> decoding.Sampling:
    values = {k: keys[k] for k in SAMPLING_KEYS if k in keys}
    if "stop" in keys:
        values["stop_tokens"] = keys["stop"]
    try:
        return decoding.Sampling(**values)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _source(keys: dict) -> tuple[list[dict], str]:
    if "prompts" in keys:
        found = prompts.read_file(keys["prompts"])
        return found[:keys["limit"]] if "limit" in keys else found, str(
            Path(keys["prompts"]).absolute())
    split = keys.get("split", "validation")
    return prompts.from_task(keys["task"], split, keys.get("limit")), f"{keys['task']}:{split}"


def _encode(records: list[dict], vocabulary, s: decoding.Sampling, max_length: int,
            where: str) -> list[list[int]]:
    ids = [list(vocabulary.encode(r["prompt"])) for r in records]
    for i, row in enumerate(ids):
        if not row:
            raise ConfigError(f"{where}: prompt {i + 1} is empty after tokenizing")
        need = len(row) + 1 + s.max_new_tokens
        if need > max_length:
            raise ConfigError(f"{where}: prompt {i + 1} is {len(row)} tokens; with "
                              f"max_new_tokens={s.max_new_tokens} it needs a cache of {need} "
                              f"> max_length={max_length}")
    return ids


def prepare(keys: dict) -> Job:
    out = Path(keys["out"]).expanduser().absolute()
    if out.suffix != ".jsonl":
        raise ConfigError(f"out={keys['out']}: expected a .jsonl file name")
    if not out.parent.is_dir():
        raise ConfigError(f"out={keys['out']}: no directory {out.parent}")
    s = _sampling(keys)
    batch_size = keys.get("batch_size", 8)
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size}: must be at least 1")
    records, source = _source(keys)
    loaded = loading.load(keys["checkpoint"], keys.get("model"), keys.get("config_dir"),
                          keys.get("dtype"))
    if "stop_text" in keys:  # a stop string: its tokens in the model's vocabulary
        stop = list(loaded.vocabulary.encode(keys["stop_text"].replace("\\n", "\n")))
        if not stop:
            raise ConfigError(f"stop_text={keys['stop_text']!r}: no tokens")
        s = dataclasses.replace(s, stop_sequences=(*s.stop_sequences, tuple(stop)))
    ids = _encode(records, loaded.vocabulary, s, keys.get("max_length", 2048), source)
    record = {"checkpoint": str(loaded.step_dir), "model": loaded.model,
              "sampling": dataclasses.asdict(s), "prompts": source,
              "prompts_sha256": hashlib.sha256(json.dumps(records).encode()).hexdigest(),
              "count": len(records)}
    return Job(loaded, records, ids, s, out, record, batch_size, _resumable(out, record))


def _resumable(out: Path, record: dict) -> list[str]:
    """The lines of a stopped run of the same command; a finished or other one is refused."""
    path = record_path(out)
    if not out.exists() and not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    same = {k: old.get(k) for k in record} == json.loads(json.dumps(record))
    if old.get("status") == "stopped" and same and out.is_file():
        return out.read_text(encoding="utf-8").splitlines()
    raise ConfigError(f"out={out}: exists (a finished or other run's); choose another name")


class _Progress:
    """prompts done, tokens generated and tokens/s on stderr (rewritten on a terminal)."""

    def __init__(self, total: int, prog: str):
        self.total, self.prog, self.tokens, self.t0 = total, prog, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def start(self) -> None:
        """Time from here (after the compile)."""
        self.t0 = time.perf_counter()

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def update(self, done: int, new_tokens: int) -> None:
        self.tokens += new_tokens
        line = (f"{self.prog}: {done}/{self.total} prompts, {self.tokens} tokens, "
                f"{self.rate():.1f} tokens/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)


def _line(index: int, record: dict, decodes: list, vocabulary) -> str:
    outputs = [{"text": vocabulary.decode(ids), "ids": ids, "score": score}
               for ids, score in decodes]
    return json.dumps({"index": index, **record, "outputs": outputs}, ensure_ascii=False)


def _stop_on_signal() -> dict:
    """SIGTERM/SIGINT set a flag; the loop stops after the batch it is in."""
    flag = {"signal": None}

    def handler(signum, frame):
        flag["signal"] = signal.Signals(signum).name

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return flag


def run(job: Job, prog: str) -> dict[str, Any]:
    lines = list(job.done)
    start = len(lines)
    flag = _stop_on_signal()
    progress = _Progress(len(job.records), prog)
    batches = decoding.generate(job.loaded.module, job.loaded.params, job.loaded.vocabulary,
                                job.token_ids[start:], job.sampling, job.batch_size,
                                on_compiled=progress.start)
    new_tokens = 0
    for i, decodes in enumerate(batches, start):
        lines.append(_line(i, job.records[i], decodes, job.loaded.vocabulary))
        new_tokens += sum(len(ids) for ids, _ in decodes)
        if (i + 1 - start) % job.batch_size == 0 or i + 1 == len(job.records):
            progress.update(i + 1, new_tokens)
            new_tokens = 0
            if flag["signal"] and i + 1 < len(job.records):
                if progress.tty:
                    print(file=sys.stderr)
                _write(job, lines, "stopped", progress)
                raise Preempted(f"{prog}: stopped by {flag['signal']} after {i + 1} of "
                                f"{len(job.records)} prompts (kept in {job.out}; the same "
                                "command resumes)")
    if progress.tty:
        print(file=sys.stderr)
    return _write(job, lines, "finished", progress)


def _write(job: Job, lines: list[str], status: str, progress: _Progress) -> dict:
    summary = {"out": str(job.out), "done": len(lines), "tokens": progress.tokens,
               "tokens_per_s": progress.rate()}
    atomic.write_lines(job.out, lines)
    atomic.write_lines(record_path(job.out), [json.dumps(
        {**job.record, "status": status, **summary}, indent=2)])
    return summary
