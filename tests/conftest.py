"""Shared fixtures: composing the shipped configs the way the CLI does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from capibara_exp.cli import register_resolvers
from capibara_exp.paths import CONF_DIR

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The composed config for a command line, without running anything."""
    register_resolvers()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["model_dir=/tmp/capibara-model", *(overrides or [])])


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the whole session; tasks build their files there on first read."""
    path = Path(os.environ.get("CAPIBARA_TEST_DATA_DIR") or tmp_path_factory.mktemp("data"))
    os.environ["CAPIBARA_DATA_DIR"] = str(path)
    return path
