"""merge_report.json and the plot of per-candidate against merged validation loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capibara_exp.consensus.gate import UNVERIFIED


def _loss_summary(losses: dict[str, float], accepted: list[str], best_name: str | None,
                  merged: float | None) -> dict:
    scored = [losses[n] for n in accepted if n in losses]
    return {"best_candidate": losses.get(best_name) if best_name else None, "merged": merged,
            "mean_accepted": float(np.mean(scored)) if scored else None}


def build(candidates: Sequence[Any], spec: Any, gate: Any, solved: dict,
          merged_loss: tuple[float | None, float | None], ckpt: Path, seconds: float) -> dict:
    """Candidates, weights, integrity, rejections with reasons, and validation loss before
    and after: on the selection batches (`val_loss`, what chose the merge) and on held-out
    report batches (`held_out_loss`, what the merge is judged by)."""
    weights = solved.get("weights")
    accepted = [c.name for c in gate.accepted]
    rows = []
    for c in candidates:
        w = None
        if weights is not None and c.name in accepted:
            w = float(weights[accepted.index(c.name)])
        rows.append({"name": c.name, "checkpoint": str(c.step_dir), "step": c.step,
                     "accepted": c.name in accepted, "rejected_because": gate.rejected.get(c.name),
                     "integrity": gate.integrity.get(c.name), "val_loss": gate.val_loss.get(c.name),
                     "held_out_loss": gate.held_out_loss.get(c.name), "weight": w,
                     "params": _params_item(c)})
    scored = [n for n in accepted if n in gate.val_loss]
    best = min(scored, key=gate.val_loss.__getitem__) if scored else None  # chosen on selection
    merged, merged_held_out = merged_loss
    rep = {"method": dataclasses.asdict(spec), "merged_checkpoint": str(ckpt),
           "candidates": rows, "rejections": dict(gate.rejected),
           # Merged although no manifest vouched for their bytes (require_manifest=false).
           "unverified": [n for n in accepted if gate.integrity.get(n) == UNVERIFIED],
           "val_loss": _loss_summary(gate.val_loss, accepted, best, merged),
           "held_out_loss": (_loss_summary(gate.held_out_loss, accepted, best, merged_held_out)
                             if merged_held_out is not None else None),
           "seconds": seconds}
    if "nearest_relative_distance" in solved:  # candidates without lineage, by distance
        rep["relative_distance"] = solved["nearest_relative_distance"]
    if "layer_weights" in solved:
        rep["learned"] = {"layer_weights": np.asarray(solved["layer_weights"]).tolist(),
                          "loss_per_step": solved["learn_history"]}
    if "greedy_log" in solved:
        rep["greedy_soup"] = solved["greedy_log"]
    if "ties_thresholds" in solved:
        rep["ties_thresholds"] = [float(t) for t in solved["ties_thresholds"]]
    return rep


def _params_item(candidate: Any) -> str | None:
    """Which weights of the candidate were (or would have been) merged; None if unreadable."""
    try:
        return candidate.params_item
    except Exception:  # orbax raises many types for unreadable metadata
        return None


def warning_lines(rep: dict) -> list[str]:
    """Lines a front end prints: every candidate the gate rejected and why, candidates
    merged without integrity verification, and a merge whose reported loss is in-sample."""
    lines = [f"rejected {name}: {why}" for name, why in rep["rejections"].items()]
    if rep["unverified"]:
        lines.append(f"warning: merged {len(rep['unverified'])} candidate(s) with no checksum "
                     f"manifest, integrity unverified: {', '.join(rep['unverified'])}")
    if rep["held_out_loss"] is None and rep["val_loss"]["merged"] is not None and (
            "greedy_soup" in rep or "learned" in rep):
        lines.append("warning: no report batches: the merged validation loss is measured on the "
                     "batches that chose the merge (in-sample)")
    return lines


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

    key = "held_out_loss" if rep["held_out_loss"] is not None else "val_loss"
    rows = [dict(r, val_loss=r[key]) for r in rep["candidates"] if r[key] is not None]
    merged = rep[key]["merged"]
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
    ax.set_ylabel(("held-out" if key == "held_out_loss" else "validation") + " loss / token")
    ax.set_title("candidates (grey: rejected by the gate) vs merged", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
