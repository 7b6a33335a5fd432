"""Shared fixtures: composing the shipped configs the way the CLI does."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from capibara_exp.base import environment
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli.common import register_resolvers

# What the console scripts set up in their main (JAX's platforms: no TPU probe on a machine
# without one), for the runs tests make in this process.
environment.select_platform()

# libtpu (the test extra's TPU compiler) is published for Linux x86_64 only: elsewhere the
# ahead-of-time TPU compiles cannot run, and their tests say so.
LIBTPU_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"
needs_libtpu = pytest.mark.skipif(
    not LIBTPU_PLATFORM,
    reason=f"libtpu is published for Linux x86_64 only, not {sys.platform} {platform.machine()}")
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The composed config for a command line, without running anything."""
    register_resolvers()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["model_dir=/tmp/capibara-model", *(overrides or [])])


def _session_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory for the whole test run: under pytest-xdist, the one all workers share."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the whole session, the text corpus built in it as a run's data
    preparation (or `capibara-exp-data`) builds it: the tasks only read. The E2B data are
    built by `e2b_data`. pytest-xdist's workers share it (the corpus is written atomically,
    its manifest last, and the routing build holds a lock, so one worker builds while the
    others wait)."""
    from capibara_exp.data import corpus

    path = Path(os.environ.get("CAPIBARA_TEST_DATA_DIR") or _session_dir(tmp_path_factory, "data"))
    path.mkdir(parents=True, exist_ok=True)
    os.environ["CAPIBARA_DATA_DIR"] = str(path)
    corpus.build_corpus(path)
    return path


@pytest.fixture
def corpus_data(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The session's data dir with its text corpus, for a test that reads the corpus' task
    in this process: $CAPIBARA_DATA_DIR set to it for the test (an earlier test in the
    worker may have pointed it at data of its own, and the task only reads)."""
    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(data_dir))
    return data_dir


@pytest.fixture
def capibara_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A command's caches in a fresh $XDG_CACHE_HOME (the compose and parsed-config caches
    on, as a user has them), resolvers registered, cwd the test's dir: capibara-exp's
    cache dir, empty."""
    register_resolvers()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CAPIBARA_COMPOSE_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache" / "capibara-exp"


@pytest.fixture(scope="session")
def _e2b_built(data_dir: Path) -> Path:
    from capibara_exp.data.e2b import build

    build.ensure_built(data_dir)
    return data_dir


@pytest.fixture
def e2b_data(_e2b_built: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The E2B routing data built (shipped settings) in the session's data dir, as
    `capibara-exp-data` or a run's data preparation builds them: the tasks only read, from
    $CAPIBARA_DATA_DIR, set here for the test (an earlier test in the worker may have
    pointed it at data of its own)."""
    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(_e2b_built))
    return _e2b_built


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JAX's persistent compilation cache for the session, shared by pytest-xdist's workers
    and inherited by every subprocess a test starts: the many small runs of the same tiny
    model compile their steps once. Only the XLA backend compile is cached (keyed by the
    program, devices and flags), so what a test checks is unchanged. It is the user cache
    dir runs default to (compilation_cache_dir), moved under the session's temp dir."""
    cache_home = _session_dir(tmp_path_factory, "cache")
    os.environ["XDG_CACHE_HOME"] = str(cache_home)
    path = cache_home / "capibara-exp" / "xla"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path
