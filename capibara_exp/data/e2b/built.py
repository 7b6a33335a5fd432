"""The built E2B routing data as the training side reads them: where they live and their
manifest, never building. `capibara-exp-data` and a run's data preparation
(experiment.prepare_data, before JAX starts) are the build's two doors, both through
build.ensure_built; a SeqIO task that finds no build says which command makes one
(read_manifest, which the text corpus' task shares)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from capibara_exp.base.errors import NotBuilt

DATASET = "e2b_routing"
MANIFEST = "manifest.json"  # written last: data without it are not built (or half built)
BUILD_COMMAND = "capibara-exp-data"
# E2B-format logs the code-generation task reads instead of the built ones (no build needed)
CODEGEN_LOGS_ENV = "CAPIBARA_CODEGEN_LOGS"


def dataset_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / DATASET


def manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of the data built under `data_dir`; NotBuilt naming the command to run
    when there is none."""
    return read_manifest(dataset_dir(data_dir) / MANIFEST, "E2B routing data", data_dir)


def read_manifest(path: Path, what: str, data_dir: str | os.PathLike, *args: str) -> dict:
    """A build's manifest at `path`; NotBuilt, one line naming `what` is missing under
    `data_dir` and the `capibara-exp-data` command (with `args`) that builds it. Shared
    by every data set a task reads and a build writes (the E2B data, the text corpus)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        command = " ".join([BUILD_COMMAND, f"data_dir={data_dir}", *args])
        raise NotBuilt(f"{path}: no {what} built under {data_dir}; build it with "
                       f"`{command}`") from None
