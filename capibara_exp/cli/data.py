"""Console script `capibara-exp-data`: build the E2B / ACE / MoE routing data (Hydra).

Composes conf/data_build.yaml with the command line and calls `build.ensure_built`; the
build's summary is printed (the manifest's path, per input file accepted / quarantined /
deduplicated / filtered counts, warnings, quarantine and scrubbing figures). Examples:
  capibara-exp-data                                  # build under ./data (if not built)
  capibara-exp-data data_dir=/tmp/d force=true filters.min_quality=0.5
  capibara-exp-data 'inputs.logs=[my_e2b_logs.jsonl]' 'collect.sources=[]'
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from capibara_exp.cli.common import checked_argv, user_errors
from capibara_exp.paths import CONF_DIR

PROG = "capibara-exp-data"


@hydra.main(config_path=str(CONF_DIR), config_name="data_build", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from capibara_exp.data.e2b import build

    settings = OmegaConf.to_container(cfg, resolve=True)
    data_dir, force = settings.pop("data_dir"), settings.pop("force")
    settings.pop("hydra", None)
    # BuildError, NoExamplesError, bad settings (ConfigErrors): named in the message
    with user_errors(PROG):
        manifest = build.ensure_built(data_dir, build.build_config(settings), force=force)
    print(json.dumps(build.summary(manifest, data_dir), indent=2, ensure_ascii=False))


def main(argv: list[str] | None = None) -> None:
    _, _, hydra_argv = checked_argv(PROG, "data_build", sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *hydra_argv]
    _app()


if __name__ == "__main__":
    main()
