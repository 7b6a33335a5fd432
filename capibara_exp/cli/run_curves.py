"""A run's curves from metrics.jsonl, rendered to a PNG (`capibara-exp-plot RUN_DIR`)."""

from __future__ import annotations

import re
from pathlib import Path

from capibara_exp.base.errors import ConfigError

# Metrics worth a panel, in order, each drawn for train and train_eval where present.
PANELS = ("loss", "accuracy", "learning_rate", "grad_norm", "tokens_per_s", "mfu",
          "skipped_steps", "data_wait_share")
# MoE runs: one panel per metric with a line per MoE layer (experts/layers_<i>/<name>), then
# the layer-mean router losses and router supervision.
EXPERT_LAYER_PANELS = ("expert_usage", "fraction_tokens_left_behind", "router_confidence",
                       "max_load")
EXPERT_PANELS = ("experts/auxiliary_loss", "experts/router_z_loss",
                 "experts/router_supervision_loss", "experts/router_label_accuracy")
_LAYER_RE = re.compile(r"^experts/(layers_\d+)/(\w+)$")


def read_records(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (one JSON object per line)."""
    from capibara_exp.base.metrics_file import read_records as read
    from capibara_exp.base.metrics_file import tell_damaged

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"no metrics.jsonl in {run_dir}")
    records, damaged = read(path)
    tell_damaged(path, damaged)
    return records


def series(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric of one split, in file order."""
    rows = [(r["step"], r[key]) for r in records if r.get("split") == split and key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def panels(records: list[dict]) -> dict[str, list[str]]:
    """Panel title -> the metric keys drawn in it, for the metrics the run has."""
    present = {k for r in records if r.get("split") in ("train", "train_eval") for k in r}
    out = {k: [k] for k in PANELS if k in present}
    layers: dict[str, list[str]] = {}
    for key in sorted(present, key=_layer_order):
        found = _LAYER_RE.match(key)
        if found and found.group(2) in EXPERT_LAYER_PANELS:
            layers.setdefault(found.group(2), []).append(key)
    out.update({f"experts: {name} per layer": layers[name]
                for name in EXPERT_LAYER_PANELS if name in layers})
    out.update({k: [k] for k in EXPERT_PANELS if k in present})
    return out


def _layer_order(key: str) -> tuple:
    found = _LAYER_RE.match(key)
    return (int(found.group(1).split("_")[1]), key) if found else (-1, key)


def render(run_dir: Path, out: Path) -> Path:
    """Draw one panel per metric present (train and train_eval) and save the figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    records = read_records(run_dir)
    chosen = panels(records)
    if not chosen:
        raise ConfigError(f"{run_dir}/metrics.jsonl has none of {PANELS}")
    cols = min(len(chosen), 3)
    rows = -(-len(chosen) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, chosen.items(), strict=False):
        for key in keys:
            layer = _LAYER_RE.match(key)
            for split, style in (("train", "-"), ("train_eval", "o-")):
                steps, values = series(records, split, key)
                if steps:
                    label = f"{layer.group(1)} {split}" if layer else split
                    ax.plot(steps, values, style, label=label, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(str(run_dir), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
