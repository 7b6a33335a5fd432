"""Run metrics: metrics.jsonl, TensorBoard event files, and a live progress line."""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tensorboardX import SummaryWriter

from capibara_exp.base.environment import copy_to_run_log
from capibara_exp.base.metrics_file import read_records, tell_damaged


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Per-token averages from summed step metrics (sums over any number of steps)."""
    tokens = max(sums.get("weight_sum", 0.0), 1.0)
    out = {
        "loss": sums["loss_sum"] / tokens,
        "cross_ent_loss": sums["cross_ent_sum"] / tokens,
        "z_loss": sums["z_loss_sum"] / tokens,
        "accuracy": sums["correct_sum"] / tokens,
        "target_tokens": sums.get("weight_sum", 0.0),
    }
    out["perplexity"] = math.exp(min(out["cross_ent_loss"], 50.0))
    # Per-batch means (e.g. MoE router metrics): their sums over the summed batch count.
    batches = sums.get("batch_count", 0.0)
    for key, value in sums.items():
        if key.startswith("batch_mean/") and batches:
            out[key.removeprefix("batch_mean/")] = value / batches
    return out


PEAK_FILE = "peak_flops.json"


@functools.cache
def matmul_peak_flops(n: int = 2048, repeats: int = 6, dtype: str = "float32") -> float:
    """Best observed FLOP/s of an n x n x n jitted matmul in `dtype` on the default device
    (once per process and dtype: the figure MFU is measured against)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_peak_flops(model_dir: str | Path, dtype: str = "float32") -> float:
    """This machine's measured matmul peak in the model's compute dtype, cached in the run
    dir (with its dtype, how and when it was measured) so a resumed run's MFU is measured
    against the same figure (experiment.machine_peak measures again one that went stale)."""
    path = Path(model_dir) / PEAK_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("dtype", "float32") == dtype:
            return float(stored["matmul_peak_flops"])
    peak = matmul_peak_flops(dtype=dtype)
    path.write_text(json.dumps({"matmul_peak_flops": peak, "dtype": dtype,
                                "method": peak_method(dtype), "measured_at": time.time()}) + "\n")
    return peak


def peak_method(dtype: str, n: int = 2048, repeats: int = 6) -> str:
    """How matmul_peak_flops measures, in words (kept beside the figure)."""
    import jax

    device = jax.devices()[0]
    kind = "" if device.device_kind == device.platform else f" ({device.device_kind})"
    return f"best of {repeats} jitted {n}x{n}x{n} {dtype} matmuls on one {device.platform} " \
        f"device{kind}"


def model_flops_per_token(config: Any, length: int, moe_config: Any = None) -> float:
    """Analytic training FLOPs per token of a network config (model_facts' PaLM count: 6 x
    the matmul weights a token meets, k of E experts in a MoE layer, plus the attention
    term over the keys each layer attends)."""
    from capibara_exp.base import model_facts

    return model_facts.train_flops_per_token(model_facts.sizes(config, moe_config), length)


def last_metrics(model_dir: str | Path, split: str) -> dict[str, float] | None:
    """The last record of a split in model_dir/metrics.jsonl, without step/split/time."""
    path = Path(model_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    records, damaged = read_records(path)
    tell_damaged(path, damaged)
    last = None
    for record in records:
        if record.get("split") == split:
            last = record
    if last is None:
        return None
    return {k: v for k, v in last.items() if k not in ("step", "split", "time")} | \
        {"step": last["step"]}


def final_metrics(model_dir: str | Path) -> dict[str, float] | None:
    """What a run returns (a sweep's objective): the last train_eval metrics and the last
    inference_eval ones ('<task>/pass@1', ...) beside them."""
    train_eval = last_metrics(model_dir, "train_eval")
    infer = last_metrics(model_dir, "inference_eval") or {}
    infer.pop("step", None)
    if train_eval is None and not infer:
        return None
    return {**(train_eval or {}), **infer}


class MetricsWriter:
    """One writer per run: JSON lines plus a TensorBoard directory per split."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.model_dir.mkdir(parents=True, exist_ok=True)
        path = self.model_dir / "metrics.jsonl"
        self._jsonl = open(path, "a", buffering=1)
        if path.stat().st_size and not path.read_bytes()[-1:] == b"\n":
            self._jsonl.write("\n")  # a line cut by a crash stays one damaged line
        self._tb: dict[str, SummaryWriter] = {}

    def tensorboard(self, split: str) -> SummaryWriter:
        if split not in self._tb:
            self._tb[split] = SummaryWriter(str(self.model_dir / split))
        return self._tb[split]

    def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        record = {"step": int(step), "split": split, "time": time.time(),
                  **{k: float(v) for k, v in metrics.items()}}
        try:
            self._jsonl.write(json.dumps(record) + "\n")
        except OSError as err:  # a full disk: name the file (a write's error does not)
            raise OSError(err.errno, err.strerror, str(self.model_dir / "metrics.jsonl")) \
                from None
        tb = self.tensorboard(split)
        for key, value in metrics.items():
            tb.add_scalar(key, float(value), int(step))

    def text(self, step: int, split: str, tag: str, text: str) -> None:
        self.tensorboard(split).add_text(tag, text, int(step))

    def close(self) -> None:
        self._jsonl.close()
        for tb in self._tb.values():
            tb.close()


class NullWriter:
    """The metrics writer of processes other than 0: they report nothing."""

    def write(self, *args: Any) -> None:
        pass

    def text(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


PREFIX = "capibara-exp: "


class Progress:
    """A one-line status: step, loss, tokens/s and ETA; redrawn in place on a terminal. Every
    line starts with capibara-exp's prefix, the step lines too (a console's lines, and the
    run log's, all say whose they are)."""

    def __init__(self, total_steps: int, stream: TextIO | None = None):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr  # looked up now: a redirected stderr counts
        self.logged = stream is None  # the console's lines go in the run log too
        self.tty = self.stream.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, step_s: float,
               data_wait_share: float | None = None) -> None:
        eta = max(self.total_steps - step, 0) * step_s
        line = (f"{PREFIX}step {step}/{self.total_steps}  loss {loss:.4f}  "
                f"{tokens_per_s / 1e3:.1f}k tok/s  {step_s * 1e3:.0f} ms/step")
        if data_wait_share is not None:
            line += f"  data wait {data_wait_share:.1%}"
        line += f"  ETA {_clock(eta)}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        if self.logged:
            copy_to_run_log(line)

    def message(self, text: str) -> None:
        """A line of its own, with capibara-exp's prefix (the step lines are the bar)."""
        self.stream.write(("\r\033[K" if self.tty else "") + PREFIX + text + "\n")
        self.stream.flush()
        if self.logged:
            copy_to_run_log(PREFIX + text)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
