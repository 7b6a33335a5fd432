"""Console script `capibara-exp-data`: build the data the tasks read (Hydra): the text
corpus (data/corpus.py) and the E2B / ACE / MoE routing data.

Composes conf/data_build.yaml with the command line and, for each of `datasets`, calls its
build (`corpus.build_corpus`, `build.ensure_built`: what a run's data preparation calls);
the summary is printed (the manifests' paths; for the routing data per input file
accepted / quarantined / deduplicated / filtered counts, warnings, quarantine and
scrubbing figures). Examples:
  capibara-exp-data                                  # build both under ./data (if not built)
  capibara-exp-data data_dir=/tmp/d 'datasets=[bytes_lm]'   # the text corpus only
  capibara-exp-data data_dir=/tmp/d force=true filters.min_quality=0.5
  capibara-exp-data 'inputs.logs=[my_e2b_logs.jsonl]' 'collect.sources=[]'
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from capibara_exp.base import run_lock
from capibara_exp.base.errors import PREEMPTED_EXIT_CODE, ConfigError, Preempted
from capibara_exp.cli import app, guards
from capibara_exp.cli.common import user_errors
from capibara_exp.cli.shell import console
from capibara_exp.data import corpus
from capibara_exp.data.e2b import built

PROG = "capibara-exp-data"
DATASETS = (corpus.CORPUS_NAME, built.DATASET)  # what `datasets` may name


def _build(cfg: DictConfig) -> None:
    settings = OmegaConf.to_container(cfg, resolve=True)
    data_dir, force = settings.pop("data_dir"), settings.pop("force")
    datasets = settings.pop("datasets")
    settings.pop("hydra", None)
    made = _not_yet(Path(data_dir), datasets)
    try:
        # the routing data first: a build that stops on them (bad inputs) leaves the corpus be
        summary = _build_e2b(data_dir, force, settings) if built.DATASET in datasets else {}
        if corpus.CORPUS_NAME in datasets:
            manifest = corpus.build_corpus(data_dir, force=force)  # its own phase line
            summary[corpus.CORPUS_NAME] = corpus.summary(manifest, data_dir)
    except BaseException as err:
        if not isinstance(err, Preempted | KeyboardInterrupt) and \
                getattr(err, "code", None) != PREEMPTED_EXIT_CODE:
            for path in made:  # all or nothing: one data set failing undoes the other
                shutil.rmtree(path, ignore_errors=True)
        raise
    print(json.dumps(summary, indent=2, ensure_ascii=False))


def _not_yet(data_dir: Path, datasets: list[str]) -> list[Path]:
    """What this command would create: the data dir, else the data sets' dirs it lacks."""
    if not data_dir.exists():
        return [data_dir]
    dirs = {corpus.CORPUS_NAME: corpus.corpus_dir(data_dir),
            built.DATASET: built.dataset_dir(data_dir)}
    return [dirs[name] for name in datasets if not dirs[name].exists()]


def _build_e2b(data_dir: str, force: bool, settings: dict) -> dict:
    """The routing data built (or reused); their summary."""
    from capibara_exp.base import phases

    with phases.importing("the data build (the E2B SDK)"):
        from capibara_exp.data.e2b import build

    # BuildError, NoExamplesError, bad settings (ConfigErrors): named in the message
    with user_errors(PROG), phases.phase(f"building the data under {data_dir}"):
        manifest = build.ensure_built(data_dir, build.build_config(settings), force=force)
    return build.summary(manifest, data_dir)


def check_paths(cfg: DictConfig) -> None:
    """`datasets` names known builds; the input logs and playbooks exist, none inside the
    dir the build rewrites; data_dir is a directory this process can write (or make) that
    no other build holds: checked before anything is made."""
    datasets = _datasets(cfg.get("datasets"))
    inputs = {}
    for key in ("logs", "playbooks") if built.DATASET in datasets else ():
        for i, path in enumerate(cfg.inputs.get(key) or []):
            inputs[f"inputs.{key}[{i}]"] = guards.existing_input(f"inputs.{key}[{i}]", path)
    data_dir = guards.writable_dir("data_dir", cfg.data_dir)
    if built.DATASET not in datasets:
        return  # the corpus alone: written atomically, its manifest last (data/corpus.py)
    rewritten = built.dataset_dir(data_dir).resolve()  # what a build rewrites
    run_lock.refuse_if_held(rewritten, "data_dir", shown=cfg.data_dir)  # another build runs
    for key, path in inputs.items():
        if rewritten in path.resolve().parents:
            raise ConfigError(f"{key}={path}: lies inside {rewritten}, which the build rewrites; "
                              "inputs are read-only, so keep them elsewhere")


def _datasets(value: object) -> list[str]:
    """`datasets`: a list of one or more of DATASETS, or a ConfigError naming it."""
    names = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    if not isinstance(names, list) or not names or any(n not in DATASETS for n in names):
        raise ConfigError(f"datasets={names}: not a list of one or more of "
                          f"{', '.join(DATASETS)}, e.g. 'datasets=[{DATASETS[0]}]'")
    return names


_app = app.hydra_app("data_build", _build)


@console(PROG)
def main(argv: list[str] | None = None) -> None:
    app.run(PROG, "data_build", sys.argv[1:] if argv is None else argv, lambda: _app(),
            check=check_paths)


if __name__ == "__main__":
    main()
