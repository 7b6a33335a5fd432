"""`capibara-exp-plot RUN_DIR`: a run's curves from metrics.jsonl, rendered to a PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Train metrics worth a panel, in order; eval (train_eval) curves share the loss panels.
PANELS = ("loss", "accuracy", "learning_rate", "grad_norm", "tokens_per_s", "mfu",
          "skipped_steps", "data_wait_share")


def read_records(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (one JSON object per line)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"capibara-exp-plot: no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric of one split, in file order."""
    rows = [(r["step"], r[key]) for r in records if r.get("split") == split and key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def render(run_dir: Path, out: Path) -> Path:
    """Draw one panel per metric present (train and train_eval) and save the figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    records = read_records(run_dir)
    keys = [k for k in PANELS
            if series(records, "train", k)[0] or series(records, "train_eval", k)[0]]
    if not keys:
        raise SystemExit(f"capibara-exp-plot: {run_dir}/metrics.jsonl has none of {PANELS}")
    cols = min(len(keys), 3)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for split, style in (("train", "-"), ("train_eval", "o-")):
            steps, values = series(records, split, key)
            if steps:
                ax.plot(steps, values, style, label=split, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(str(run_dir), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="capibara-exp-plot", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="a run dir (model_dir) with metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    out = render(args.run_dir, args.out or args.run_dir / "curves.png")
    print(out)
    return out


if __name__ == "__main__":
    main()
