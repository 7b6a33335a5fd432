"""The mesh planner's outputs: a Markdown table, a PNG, results JSON, and the winner as a
conf/partitioning entry that `capibara-exp ... partitioning=<name>` runs."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from capibara_exp.base import model_facts
from capibara_exp.base.paths import CHECKOUT, CONF_DIR
from capibara_exp.base.topologies import Chip
from capibara_exp.tuning.aot import oom_bytes
from capibara_exp.tuning.estimate import calibration_note
from capibara_exp.tuning.measure import spearman
from capibara_exp.tuning.mesh_space import Candidate
from capibara_exp.tuning.search import Result

REPORT_MD = "mesh_report.md"
REPORT_PNG = "mesh_report.png"
RESULTS_JSON = "mesh_results.json"
GIB = 2**30


def _ranked(results: Sequence[Result]) -> list[Result]:
    unique = {r.candidate: r for r in results}.values()
    return sorted(unique, key=lambda r: (not r.feasible, -r.value, r.candidate.key))


def _ms(seconds: float) -> str:
    """Milliseconds with three significant figures (tiny models step in microseconds)."""
    return f"{seconds * 1e3:.3g}"


def _confirm_line(ranked: Sequence[Result], cost: dict[str, Any]) -> str:
    """What confirming early-stop rows cost (tuning/confirm.py), when any was."""
    confirmed = sum("early_compile_s" in r.record for r in ranked)
    if not confirmed and not any(r.record.get("compile_mode") == "early_stop" for r in ranked):
        return ""
    return (f" Ranked by early-stop compiles; {confirmed} confirmed by a full compile "
            f"({cost.get('confirm_compiles', 0)} new, {cost.get('confirm_s_total', 0.0):.0f} s "
            "of it): the winner, the best few and those near the HBM budget; their memory is "
            "XLA's peak, the others' the buffer assignment's total.")


def _row(r: Result) -> str:
    c, rec = r.candidate, r.record
    needed = rec.get("memory_bytes") or oom_bytes(rec.get("reason", ""))
    memory = f"{needed / GIB:.2f}" if needed else "-"
    if r.feasible:
        est = _ms(rec["est_step_s"])
        mfu = f"{rec['est_mfu']:.1%}"
        parts = " / ".join(_ms(rec[k]) for k in ("est_compute_s", "est_memory_s",
                                                  "est_collective_s"))
    else:
        est = mfu = parts = "-"
    measured = _ms(rec["measured_step_s"]) if "measured_step_s" in rec else "-"
    status = "ok" if r.feasible else rec.get("reason", "")[:90].replace("|", "/")
    compile_s = "pruned" if rec.get("pruned") else f"{rec.get('compile_s', 0):.1f}"
    if "early_compile_s" in rec:  # an early-stop row confirmed by a full compile
        compile_s = f"{rec['early_compile_s']:.1f} early + {compile_s} full"
    elif rec.get("compile_mode") == "early_stop":
        compile_s += " early"
    return (f"| {c.data} x {c.expert} x {c.model} | {c.num_microbatches} | {c.remat_policy} | "
            f"{'yes' if c.fsdp else 'no'} | {c.attention} | {c.activation_sharding} | "
            f"{c.batch_size} | {memory} | {est} | "
            f"{parts} | {mfu} | {measured} | {compile_s} | {status} |")


def _measured_agreement(results: Sequence[Result]) -> dict[str, Any] | None:
    timed = [r for r in _ranked(results) if "measured_step_s" in r.record]
    if len(timed) < 2:
        return None
    est = [r.record["est_step_s"] for r in timed]
    got = [r.record["measured_step_s"] for r in timed]
    best_est = min(timed, key=lambda r: r.record["est_step_s"]).candidate.key
    best_got = min(timed, key=lambda r: r.record["measured_step_s"]).candidate.key
    return {"candidates": len(timed), "spearman": spearman(est, got),
            "best_by_estimate": best_est, "best_measured": best_got,
            "same_best": best_est == best_got}


def _calibration_line(summary: dict[str, Any]) -> str:
    """Which generations the step-time constants were fitted on, their error bar, and the
    warning for a chip of another generation."""
    line = (f"Constants fitted on {', '.join(summary['calibrated_on'])} only (MaxText's "
            f"published points; tuning/calibration.py); leave-one-out error bar "
            f"+-{summary['est_error_bar']:.1%} relative.")
    if summary["calibration_warning"]:
        line += f" **Warning: {summary['calibration_warning']}.**"
    return line


def write(out_dir: Path, cfg: DictConfig, where: str, chip: Chip, cands: Sequence[Candidate],
          results: Sequence[Result], winner: Result | None,
          replay: list[int | None] | None, cost: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """Write mesh_report.md, mesh_report.png and mesh_results.json; return the summary
    (with the search's cost, plan.cost_of, when given)."""
    ranked = _ranked(results)
    agreement = _measured_agreement(results)
    summary: dict[str, Any] = {
        "experiment": cfg.name, "topology": cfg.topology, "devices": where,
        "chip": {"kind": chip.kind, "peak_flops": chip.peak_flops, "hbm_bytes": chip.hbm_bytes,
                 "hbm_bytes_per_s": chip.hbm_bytes_per_s, "ici_bytes_per_s": chip.ici_bytes_per_s},
        "space_size": len(cands), "evaluated": len(ranked),
        "compiled": sum(not r.record.get("pruned") for r in ranked),
        "pruned": sum(bool(r.record.get("pruned")) for r in ranked),
        "feasible": sum(r.feasible for r in ranked),
        "best": ({"candidate": winner.candidate.key, **winner.record} if winner else None),
        "measured_vs_estimated": agreement,
        **calibration_note(chip),
    }
    if replay is not None:
        summary["tpe_compiles_to_optimum"] = replay
    if cost is not None:
        summary["cost"] = cost
    (out_dir / RESULTS_JSON).write_text(json.dumps(
        {**summary, "results": [{"candidate": r.candidate.key, **r.record} for r in ranked]},
        indent=1, default=float) + "\n")
    lines = _report_lines(cfg, where, chip, cands, ranked, summary, winner, replay)
    (out_dir / REPORT_MD).write_text("\n".join(lines) + "\n")
    plot(out_dir / REPORT_PNG, ranked, chip, f"{cfg.name} on {where}")
    return summary

def _report_lines(cfg: DictConfig, where: str, chip: Chip, cands: Sequence[Candidate],
                  ranked: list[Result], summary: dict[str, Any], winner: Result | None,
                  replay: list[int | None] | None) -> list[str]:
    """mesh_report.md: the chip, the space, the ranked table, the winner with its error bar,
    TPE's replay and the measured agreement."""
    lines = [
        f"# Mesh plan: {cfg.name} on {where}",
        "",
        f"Chip: {chip.kind}, {chip.peak_flops / 1e12:.1f} TFLOP/s peak, "
        f"{chip.hbm_bytes / GIB:.1f} GiB at {chip.hbm_bytes_per_s / 1e9:.0f} GB/s, ICI "
        f"{chip.ici_bytes_per_s / 1e9:.0f} GB/s. Space: {len(cands)} candidates; evaluated "
        f"{len(ranked)} ({summary['compiled']} compiled, {summary['pruned']} over the memory "
        f"bound without compiling), feasible {summary['feasible']}.",
        "",
        "Estimated step: the compiled step's schedule played on the chip (tuning/estimate.py: "
        "each op the larger of matmul FLOPs / peak and HBM bytes / bandwidth, collectives over "
        "ICI and DCN overlapping compute as XLA scheduled them, calibrated constants); MFU = "
        "model FLOPs / (step x peak). The compute / memory / collective columns sum each over "
        "the step (ms; collectives overlapped or not).",
        "",
        _calibration_line(summary),
        "",
        "| mesh data x expert x model | microbatches | remat | FSDP | attention | activations | "
        "batch | "
        "GiB/chip | est. step ms | compute / memory / collective ms | est. MFU | measured ms | "
        "compile s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[_row(r) for r in ranked],
        "",
    ]
    cost = summary.get("cost")
    if cost:
        lines += [f"Search cost: {cost['search_s']:.0f} s wall, {cost['compiles']} new compiles "
                  f"({cost['compile_s_total']:.0f} s of compiling) on {cost['compile_workers']} "
                  "worker(s)" + (f"; stopped at the budget of {cost['budget_s']:.0f} s"
                                 if cost["stopped_at_budget"] else "") + "."
                  + _confirm_line(ranked, cost), ""]
    if winner:
        bar = summary["est_error_bar"]
        lines.append(f"Best: **{winner.candidate.key}**, estimated {winner.value:.1%} MFU "
                     f"({winner.value * (1 - bar):.1%}-{winner.value * (1 + bar):.1%} at the "
                     f"calibration's +-{bar:.1%}).")
    if replay is not None:
        found = [n for n in replay if n is not None]
        lines.append(f"Exhaustive search over {len(cands)} candidates; TPE replayed on the same "
                     f"results with {len(replay)} seeds reached the optimum after "
                     f"{replay} compiles" + (f" (median {sorted(found)[len(found) // 2]})"
                                             if found else ""))
    agreement = summary["measured_vs_estimated"]
    if agreement:
        lines.append(f"Measured vs estimated over {agreement['candidates']} candidates: Spearman "
                     f"{agreement['spearman']:.2f}; best by estimate "
                     f"{agreement['best_by_estimate']}, best measured "
                     f"{agreement['best_measured']}.")
    return lines



def plot(path: Path, ranked: Sequence[Result], chip: Chip, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ranked[:40]
    labels = [r.candidate.key.replace(" batch=", "\nbatch=") for r in shown]
    fig, axes = plt.subplots(1, 3 if any("measured_step_s" in r.record for r in shown) else 2,
                             figsize=(16, 0.45 * len(shown) + 2.5), squeeze=False)
    ax = axes[0][0]
    ys = range(len(shown))
    ax.barh(ys, [r.value * 100 for r in shown],
            color=["tab:blue" if r.feasible else "lightgrey" for r in shown])
    for y, r in zip(ys, shown, strict=True):
        if not r.feasible:
            ax.text(0.5, y, r.record.get("reason", "")[:40], va="center", fontsize=7)
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("estimated MFU (%)")
    ax = axes[0][1]
    ax.barh(ys, [(r.record.get("memory_bytes") or oom_bytes(r.record.get("reason", ""))) / GIB
                 for r in shown],
            color=["tab:green" if r.feasible else "tab:red" for r in shown])
    ax.axvline(chip.hbm_bytes / GIB, color="black", linestyle="--", label="HBM per chip")
    ax.set_yticks(list(ys), [])
    ax.invert_yaxis()
    ax.set_xlabel("memory per chip (GiB)")
    ax.legend(fontsize=8)
    if axes.shape[1] == 3:
        ax = axes[0][2]
        timed = [r for r in shown if "measured_step_s" in r.record]
        ax.scatter([r.record["est_step_s"] * 1e3 for r in timed],
                   [r.record["measured_step_s"] * 1e3 for r in timed])
        ax.set_xlabel("estimated step (ms)")
        ax.set_ylabel("measured step (ms)")
        ax.set_title("measured vs estimated")
    fig.suptitle(title)
    fig.set_layout_engine("constrained")  # lays out any panel count without a warning
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _checkout_conf() -> Path | None:
    """conf/ of a source checkout (writable, an editable install), not an installed copy."""
    return CONF_DIR if CHECKOUT is not None else None


def write_partitioning(cfg: DictConfig, base: DictConfig, winner: Result, moe: bool,
                       conf_dir: str | None, out_dir: Path, name: str | None,
                       task_overrides: Sequence[str] = ()) -> tuple[Path, str]:
    """Write the winner as conf/partitioning/<name>.yaml (a `# @package _global_` entry that
    sets the partitioner, trainer and model keys it chose); return (path, command)."""
    cand = winner.candidate
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(cand.overrides(moe)))
    name = name or f"{cfg.name}_{cfg.topology}".replace("-", "_").replace(".", "_")
    root = Path(conf_dir) if conf_dir else (_checkout_conf() or out_dir / "conf")
    path = root / "partitioning" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"partitioning": OmegaConf.to_container(merged.partitioning, resolve=True),
            "trainer": {"num_microbatches": merged.trainer.num_microbatches},
            "model": {"remat_policy": merged.model.remat_policy,
                      "attention": merged.model.attention}}
    if merged.model.remat_policy in model_facts.REMAT_WITH_LISTS:  # its per-tensor lists
        body["model"].update({k: list(merged.model.get(k) or [])
                              for k in ("remat_save", "remat_offload")})
    if cand.batch_size != base.data.batch_size:
        body["data"] = {"batch_size": cand.batch_size}
    rec = winner.record
    overrides = [o for o in task_overrides
                 if not o.lstrip("+").startswith(("tune_mesh", "topology=", "partitioning="))]
    config_dir = "" if root.resolve() == CONF_DIR.resolve() else f"--config-dir {root} "
    command = f"capibara-exp {config_dir}{' '.join(overrides + [f'partitioning={name}'])}"
    header = [
        "# @package _global_",
        f"# {command}",
        f"# Written by capibara-exp-tune-mesh on {datetime.date.today()} for {cfg.name} on "
        f"{cfg.topology}:",
        f"# mesh data={cand.data} x expert={cand.expert} x model={cand.model}, "
        f"{cand.num_microbatches} microbatch(es), remat {cand.remat_policy}, "
        f"FSDP {'on' if cand.fsdp else 'off'}, {cand.attention} attention, activations "
        f"{cand.activation_sharding}; estimated "
        f"{rec['est_step_s'] * 1e3:.1f} ms/step, MFU {rec['est_mfu']:.1%}, "
        f"{rec['memory_bytes'] / GIB:.2f} GiB per chip.",
        "# Group files before experiment/ in the defaults list: the experiment must not set "
        "these keys itself.",
    ]
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False))
    return path, command
