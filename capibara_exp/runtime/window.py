"""The train loop's step bookkeeping: the NaN guard, checked on every step, and the window
of step metrics between two reports (wall time, data wait, real tokens, MFU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from capibara_exp.base.errors import TrainingDiverged
from capibara_exp.kernels import segment_stats
from capibara_exp.runtime.metrics import summarize


def sum_metrics(window: Sequence[dict]) -> dict[str, float]:
    fetched = jax.device_get(list(window))
    return {k: float(np.sum([m[k] for m in fetched])) for k in fetched[0]}


class NanGuard:
    """Stops training at the first NaN/Inf loss or gradient or, under the skip policy, after
    `max_consecutive_skips` skipped steps in a row, on every step.

    A step's flags are read one step late (after the next step is dispatched), so the
    devices never wait for the host; `check_now` reads the rest before anything is saved,
    evaluated or reported. `last_good` names the newest finite checkpoint for the message.
    """

    def __init__(self, max_consecutive_skips: int | None, last_good: Callable[[], str]):
        self.max_consecutive_skips = max_consecutive_skips  # None: stop at the first NaN/Inf
        self.last_good = last_good
        self.consecutive_skips = 0  # across reports: a run of skips may straddle one
        self.skipped_total = 0  # skipped steps in this process's training
        self._pending: list[tuple[int, dict]] = []

    def after_step(self, step: int, metrics: dict) -> None:
        names = ("skipped_steps",) if self.max_consecutive_skips else ("loss_sum", "grad_norm")
        self._pending.append((step, {k: metrics[k] for k in names}))
        if len(self._pending) > 1:
            self._check(*self._pending.pop(0))

    def check_now(self) -> None:
        while self._pending:
            self._check(*self._pending.pop(0))

    def _check(self, step: int, flags: dict) -> None:
        flags = jax.device_get(flags)
        if self.max_consecutive_skips is None:
            if not (np.isfinite(flags["loss_sum"]) and np.isfinite(flags["grad_norm"])):
                self.diverged(f"loss or gradient became NaN/Inf at step {step}")
            return
        skipped = bool(flags["skipped_steps"])
        self.skipped_total += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips >= self.max_consecutive_skips:
            self.diverged(f"loss or gradient was NaN/Inf for {self.consecutive_skips} steps in "
                          "a row (trainer.Trainer.max_consecutive_skips="
                          f"{self.max_consecutive_skips}) at step {step}")

    def diverged(self, what: str) -> None:
        self._pending.clear()
        raise TrainingDiverged(f"{what}; training stopped, nothing non-finite was saved; "
                               f"{self.last_good()}")


class StepWindow:
    """Step metrics since the last report, with the wall time, data wait and real tokens."""

    def __init__(self, tokens_per_step: int, flops_per_step: float = 0.0,
                 peak_flops: float = 0.0):
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step  # analytic model FLOPs (metrics.model_flops...)
        self.peak_flops = peak_flops  # the machine's measured matmul peak (0: no MFU)
        self.reset()

    def reset(self) -> None:
        self.metrics: list[dict] = []
        self.wait_s = 0.0
        self.tokens = 0
        self.t0 = time.perf_counter()

    @property
    def steps(self) -> int:
        return len(self.metrics)

    def next_batch(self, it) -> dict:
        t0 = time.perf_counter()
        batch = next(it)
        self.wait_s += time.perf_counter() - t0
        if "decoder_segment_ids" in batch:
            self.tokens += int(segment_stats.segment_stats(batch["decoder_segment_ids"])[0].sum())
        else:
            self.tokens += int(batch["decoder_loss_weights"].sum())
        return batch

    def add(self, metrics: dict) -> None:
        self.metrics.append(metrics)

    def pause(self, seconds: float) -> None:
        """Time spent on other work (a checkpoint) is not step time."""
        self.t0 += seconds

    def flush(self, skipped_total: int) -> dict[str, float]:
        """The report for this window (its steps already checked finite), then a new one."""
        elapsed = time.perf_counter() - self.t0
        n = self.steps
        sums = sum_metrics(self.metrics)
        m = summarize(sums)
        updated = n - sums.get("skipped_steps", 0.0)
        m.update(learning_rate=float(jax.device_get(self.metrics[-1]["learning_rate"])),
                 grad_norm=sums["grad_norm"] / max(updated, 1.0), step_time_s=elapsed / n,
                 tokens_per_s=self.tokens / elapsed, data_wait_share=self.wait_s / elapsed,
                 packing_fill=self.tokens / (n * self.tokens_per_step))
        if self.peak_flops:
            m["mfu"] = self.flops_per_step / (elapsed / n) / self.peak_flops
            m["mfu_peak_flops"] = self.peak_flops  # what it is measured against, beside it
        if "skipped_steps" in sums:
            m.update(skipped_steps=sums["skipped_steps"], skipped_steps_total=skipped_total)
        self.reset()
        return m
