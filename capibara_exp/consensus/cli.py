"""Console script `capibara-exp-merge`: compose conf/merge.yaml and call `run_merge`."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from capibara_exp.paths import CONF_DIR


def run_merge(cfg: DictConfig) -> dict:
    """Merge the configured checkpoints into cfg.out; returns the merge report."""
    from capibara_exp.consensus import evaluate, run, store
    from capibara_exp.consensus.gate import GateConfig
    from capibara_exp.consensus.merge import MergeSpec, merge

    runs = [cfg.runs] if isinstance(cfg.runs, str) else list(cfg.runs)
    if cfg.last_k:
        if len(runs) != 1:
            raise ValueError(f"last_k={cfg.last_k} merges one run's checkpoints; "
                             f"runs has {len(runs)}")
        candidates = store.last_k(runs[0], int(cfg.last_k))
    else:
        candidates = [store.candidate_from_path(r) for r in runs]
    spec_keys = ("method", "num_byzantine", "num_selected", "scale", "density", "learn_steps",
                 "learn_rate", "per_layer")
    spec = MergeSpec(weights=OmegaConf.to_container(cfg.weights) if cfg.weights else None,
                     **{k: cfg[k] for k in spec_keys})
    parts = run.load_parts(cfg.eval_config or run.find_config_gin(candidates[0].step_dir))
    evaluator = evaluate.from_parts(parts, cfg.eval_batches)
    base = store.candidate_from_path(cfg.base) if cfg.base else None
    return merge(candidates, spec, Path(cfg.out), evaluator,
                 GateConfig(**OmegaConf.to_container(cfg.gate)), base)


@hydra.main(config_path=str(CONF_DIR), config_name="merge", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from capibara_exp.consensus.gate import ConsensusError

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        print(f"capibara-exp-merge: missing mandatory value(s) {', '.join(missing)} "
              f"({CONF_DIR / 'merge.yaml'}); e.g. 'runs=[outputs/a,outputs/b]' out=merged",
              file=sys.stderr)
        sys.exit(2)
    try:
        rep = run_merge(cfg)
    except (ConsensusError, ValueError, FileNotFoundError) as err:
        print(f"capibara-exp-merge: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"capibara-exp-merge: {rep['merged_checkpoint']} (val loss {rep['val_loss']['merged']}, "
          f"best candidate {rep['val_loss']['best_candidate']})", file=sys.stderr)


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
