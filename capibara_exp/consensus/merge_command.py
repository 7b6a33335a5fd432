"""capibara-exp-merge's work: merge the checkpoints a composed conf/merge.yaml names, or run
FedAvg on one run's model and task; returns the report the console script summarises."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from capibara_exp.base.errors import ConfigError

FEDAVG = "fedavg"


def _config_gin(cfg: DictConfig, first_run: str | Path) -> Path:
    from capibara_exp.consensus import run

    return Path(cfg.eval_config) if cfg.eval_config else run.find_config_gin(first_run)


def _evaluators(cfg: DictConfig, first_run: Path, needs: list[str]) -> tuple:
    """(selection, report) evaluators from the run's config.gin; (None, None) when there is
    none and nothing needs validation; an error naming the keys when something does."""
    from capibara_exp.consensus import run, validation
    try:
        config_gin = _config_gin(cfg, first_run)
    except ConfigError as err:
        if not needs:
            return None, None  # bare checkpoints: merge without validation
        raise ConfigError(f"{', '.join(needs)} need validation batches, but {err}. Set "
                          "eval_config=<a run's config.gin>, or turn those checks off (e.g. "
                          "gate.max_val_loss_ratio=null)") from None
    return validation.from_parts(run.load_parts(config_gin), cfg.eval_batches, cfg.report_batches)


def _runs(cfg: DictConfig) -> list[str]:
    runs = [cfg.runs] if isinstance(cfg.runs, str) else list(cfg.runs)
    if not runs:
        raise ValueError("runs=[]: name at least one model dir or checkpoint_<step> dir to merge")
    return [str(r) for r in runs]


def _spec(cfg: DictConfig):
    """The MergeSpec of conf/merge.yaml: the method and every parameter the registry has."""
    from capibara_exp.composing.merge_methods import param_names, spec_from

    params = {k: cfg[k] for k in param_names()}
    if params.get("weights") is not None:
        params["weights"] = OmegaConf.to_container(cfg.weights)
    return spec_from(cfg.method, params)


def run_merge(cfg: DictConfig) -> dict:
    """Merge the configured checkpoints into cfg.out (or run FedAvg); returns the report."""
    from capibara_exp.composing.merge_methods import METHODS
    from capibara_exp.consensus import store
    from capibara_exp.consensus.gate import GateConfig
    from capibara_exp.consensus.merge import evaluation_needs, merge

    if cfg.method not in (*METHODS, FEDAVG):
        raise ValueError(f"method: unknown merge method {cfg.method!r} (choose from "
                         f"{', '.join(METHODS)}, or {FEDAVG})")
    runs = _runs(cfg)
    if cfg.method == FEDAVG:
        return run_fedavg(cfg, runs)
    spec = _spec(cfg)
    gate = GateConfig(**OmegaConf.to_container(cfg.gate))
    if cfg.last_k is not None:
        if isinstance(cfg.last_k, bool) or not isinstance(cfg.last_k, int) or cfg.last_k < 1:
            raise ValueError(f"last_k must be an integer >= 1 (or null), got {cfg.last_k!r}")
        if len(runs) != 1:
            raise ValueError(f"last_k={cfg.last_k} merges one run's checkpoints; "
                             f"runs has {len(runs)}")
        candidates = store.last_k(runs[0], int(cfg.last_k), bool(cfg.use_ema))
        if not candidates:
            raise FileNotFoundError(f"{runs[0]}: no finished checkpoint to merge (last_k)")
        if len(candidates) < cfg.last_k:
            raise ValueError(f"last_k={cfg.last_k}: {runs[0]} has {len(candidates)} finished "
                             f"checkpoint(s); last_k must be at most that")
    else:
        candidates = [store.candidate_from_path(r, use_ema=bool(cfg.use_ema)) for r in runs]
    evaluator, report_evaluator = _evaluators(cfg, candidates[0].step_dir,
                                              evaluation_needs(spec, gate))
    base = store.candidate_from_path(cfg.base) if cfg.base else None
    return merge(candidates, spec, Path(cfg.out), evaluator, gate, base,
                 report_evaluator=report_evaluator)


def run_fedavg(cfg: DictConfig, runs: list[str]) -> dict:
    """method=fedavg: FedAvg rounds on client shards of the task of the run's config.gin."""
    from capibara_exp.consensus import federated, run, validation

    if len(runs) != 1:
        raise ValueError(f"method=fedavg trains the model and task of one run; runs has "
                         f"{len(runs)}")
    fed = federated.FedConfig(**OmegaConf.to_container(cfg.fedavg))
    parts = run.load_parts(_config_gin(cfg, runs[0]))
    evaluator = None  # eval_batches=0: no validation loss per round
    if cfg.eval_batches != 0:
        evaluator, _ = validation.from_parts(parts, cfg.eval_batches, report_batches=0)
    return federated.fedavg(parts, fed, evaluator, Path(cfg.out))[1]


def console_lines(rep: dict) -> list[str]:
    """What the console script prints after a merge: every rejected candidate, the
    warnings, and the summary."""
    from capibara_exp.consensus import merge_report

    return [*([] if "rounds" in rep else merge_report.warning_lines(rep)), summary(rep)]


def summary(rep: dict) -> str:
    if "rounds" in rep:  # FedAvg
        eps = (f", noise multiplier {rep['noise_multiplier']:.4g}: epsilon {rep['epsilon']:.3g} "
               f"at delta {rep['delta']}" if rep["epsilon"] else "")
        return (f"{rep['checkpoint']} after {len(rep['rounds'])} rounds (val loss "
                f"{_num(rep['rounds'][-1]['val_loss'])}{eps})")
    loss = rep["held_out_loss"] or rep["val_loss"]
    which = "held-out loss" if rep["held_out_loss"] else "val loss"
    return (f"{rep['merged_checkpoint']} ({which} {_num(loss['merged'])}, best candidate "
            f"{_num(loss['best_candidate'])})")


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
