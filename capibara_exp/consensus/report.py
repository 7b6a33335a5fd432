"""merge_report.json and the plot of per-candidate against merged validation loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def build(candidates: Sequence[Any], spec: Any, gate: Any, solved: dict, merged_loss: float | None,
          ckpt: Path, seconds: float) -> dict:
    """Candidates, weights, rejections with reasons, validation loss before and after."""
    weights = solved.get("weights")
    accepted = [c.name for c in gate.accepted]
    rows = []
    for c in candidates:
        w = None
        if weights is not None and c.name in accepted:
            w = float(weights[accepted.index(c.name)])
        rows.append({"name": c.name, "checkpoint": str(c.step_dir), "step": c.step,
                     "accepted": c.name in accepted, "rejected_because": gate.rejected.get(c.name),
                     "val_loss": gate.val_loss.get(c.name), "weight": w})
    best = min((gate.val_loss[n] for n in accepted if n in gate.val_loss), default=None)
    rep = {"method": dataclasses.asdict(spec), "merged_checkpoint": str(ckpt),
           "candidates": rows, "rejections": dict(gate.rejected),
           "val_loss": {"best_candidate": best, "merged": merged_loss,
                        "mean_accepted": float(np.mean([gate.val_loss[n] for n in accepted
                                                        if n in gate.val_loss]))
                        if gate.val_loss else None},
           "seconds": seconds}
    if "layer_weights" in solved:
        rep["learned"] = {"layer_weights": np.asarray(solved["layer_weights"]).tolist(),
                          "loss_per_step": solved["learn_history"]}
    if "greedy_log" in solved:
        rep["greedy_soup"] = solved["greedy_log"]
    return rep


def _axis_range(rows: list[dict], merged: float | None) -> tuple[float, float]:
    """Scale to the accepted candidates and the merge, so a wild reject does not flatten them."""
    inside = [r["val_loss"] for r in rows if r["accepted"] and np.isfinite(r["val_loss"])]
    inside += [merged] if merged is not None and np.isfinite(merged) else []
    if not inside:
        inside = [r["val_loss"] for r in rows if np.isfinite(r["val_loss"])] or [1.0]
    low, high = min(inside), max(inside)
    pad = max(0.15 * (high - low), 0.02 * abs(high), 1e-3)
    return low - pad, high + 2 * pad


def plot(rep: dict, path: Path) -> Path:
    """A bar per candidate (grey: rejected; hatched and labelled: off the scale, NaN or inf)
    and a line at the merged model's validation loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rep["candidates"] if r["val_loss"] is not None]
    merged = rep["val_loss"]["merged"]
    low, high = _axis_range(rows, merged)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(rows) + 2), 3.6), dpi=110)
    for i, r in enumerate(rows):
        loss = r["val_loss"]
        off_scale = not loss <= high
        ax.bar(i, (high if off_scale else loss) - low, bottom=low,
               color="tab:blue" if r["accepted"] else "0.75", hatch="//" if off_scale else None)
        if off_scale:
            ax.text(i, high, f"{loss:.3g}" if np.isfinite(loss) else "NaN/inf", ha="center",
                    va="top", fontsize=7, rotation=90,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    if merged is not None:
        ax.axhline(merged, color="tab:red", lw=2,
                   label=f"merged ({rep['method']['method']}): {merged:.4f}")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylim(low, high)
    ax.set_ylabel("validation loss / token")
    ax.set_title("candidates (grey: rejected by the gate) vs merged", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
