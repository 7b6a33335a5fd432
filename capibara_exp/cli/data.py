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

from omegaconf import DictConfig, OmegaConf

from capibara_exp.base import run_lock
from capibara_exp.base.errors import ConfigError
from capibara_exp.cli import app, guards
from capibara_exp.cli.common import user_errors
from capibara_exp.cli.shell import console

PROG = "capibara-exp-data"


def _build(cfg: DictConfig) -> None:
    from capibara_exp.base import phases

    with phases.importing("the data build (the E2B SDK)"):
        from capibara_exp.data.e2b import build

    settings = OmegaConf.to_container(cfg, resolve=True)
    data_dir, force = settings.pop("data_dir"), settings.pop("force")
    settings.pop("hydra", None)
    # BuildError, NoExamplesError, bad settings (ConfigErrors): named in the message
    with user_errors(PROG), phases.phase(f"building the data under {data_dir}"):
        manifest = build.ensure_built(data_dir, build.build_config(settings), force=force)
    print(json.dumps(build.summary(manifest, data_dir), indent=2, ensure_ascii=False))


def check_paths(cfg: DictConfig) -> None:
    """The input logs and playbooks exist, none inside the dir the build rewrites; data_dir
    is a directory this process can write (or make) that no other build holds: checked
    before anything is made."""
    inputs = {}
    for key in ("logs", "playbooks"):
        for i, path in enumerate(cfg.inputs.get(key) or []):
            inputs[f"inputs.{key}[{i}]"] = guards.existing_input(f"inputs.{key}[{i}]", path)
    data_dir = guards.writable_dir("data_dir", cfg.data_dir)
    built = (data_dir / "e2b_routing").resolve()  # build.dataset_dir: what a build rewrites
    run_lock.refuse_if_held(built, "data_dir", shown=cfg.data_dir)  # another build runs
    for key, path in inputs.items():
        if built in path.resolve().parents:
            raise ConfigError(f"{key}={path}: lies inside {built}, which the build rewrites; "
                              "inputs are read-only, so keep them elsewhere")


_app = app.hydra_app("data_build", _build)


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    app.run(PROG, "data_build", sys.argv[1:] if argv is None else argv, lambda: _app(),
            check=check_paths)


if __name__ == "__main__":
    main()
