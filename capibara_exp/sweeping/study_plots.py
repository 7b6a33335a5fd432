"""PNG plots of a study: optimisation history (or Pareto front), importances, eval curves."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from capibara_exp.base import atomic


def write_plots(study: optuna.Study, sweep_dir: Path) -> dict[str, str]:
    """Plot name -> PNG path (or the reason it was not drawn), written under sweep_dir/plots."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    multi = len(study.directions) > 1
    plots = {
        "optimization_history": None if multi else vis.plot_optimization_history,
        "pareto_front": vis.plot_pareto_front if multi and len(study.directions) <= 3 else None,
        "param_importances": None if multi else vis.plot_param_importances,
        "intermediate_values": None if multi else vis.plot_intermediate_values,
    }
    out_dir = sweep_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    for name, plot in plots.items():
        if plot is None:
            continue
        if len(complete) < 2:
            written[name] = "not drawn: fewer than 2 complete trials"
            continue
        if name == "intermediate_values" and not any(t.intermediate_values for t in complete):
            written[name] = "not drawn: no trial reported eval values (they do with a pruner)"
            continue
        try:
            ax = plot(study)
        except (ValueError, RuntimeError) as err:  # e.g. importances of a constant parameter
            written[name] = f"not drawn: {err}"
            continue
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        path = atomic.write_with(out_dir / f"{name}.png", lambda tmp, fig=fig:
                                 fig.savefig(tmp, dpi=120, bbox_inches="tight"))
        plt.close(fig)
        written[name] = str(path)
    return written
