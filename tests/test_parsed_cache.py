"""Config files kept as OmegaConf read them (cli/parsed_cache.py): a composition from kept
files is the one from the files themselves, an edited file is read afresh (only it), and a
file that does not load fails as it always does and is never kept; a refused command keeps
nothing."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli import checks, flags, parsed_cache
from capibara_exp.cli import compose as composing


@pytest.fixture(autouse=True)
def cache_home(capibara_cache: Path) -> Path:
    return capibara_cache / "parsed" / "configs.pickle"


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files PyYAML parses (the real parser, counted)."""
    seen: list[str] = []
    real = yaml.load

    def load(stream, Loader):  # noqa: N803 - PyYAML's name
        seen.append(getattr(stream, "name", "?"))
        return real(stream, Loader=Loader)

    monkeypatch.setattr(yaml, "load", load)
    return seen


def compose(args: list[str], dirs: list[Path] = ()):
    """Composed, then kept as a command whose checks passed keeps it."""
    comp = composing.compose("config", args, list(dirs))
    composing.keep(comp)
    return comp.cfg


def kept(cache: Path) -> dict:
    return pickle.loads(cache.read_bytes()) if cache.exists() else {}


def test_a_composition_from_kept_files_is_the_one_from_the_files(
        cache_home: Path, parses: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["experiment=dense_small_rope", "ema=default"]
    first = compose(args)
    assert len(kept(cache_home)) >= 15 and len(parses) >= 15
    parses.clear()
    again = compose(args)
    assert [p for p in parses if p.endswith(".yaml")] == []  # no config file parsed again
    monkeypatch.setenv("CAPIBARA_COMPOSE_CACHE", "0")
    afresh = compose(args)
    for cfg in (first, again):
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(afresh)  # hydra node too


def test_an_edited_file_alone_is_read_afresh(tmp_path: Path, cache_home: Path,
                                             parses: list[str]) -> None:
    mine = tmp_path / "mine" / "model"
    mine.mkdir(parents=True)
    text = (CONF_DIR / "model" / "dense_tiny.yaml").read_text()
    (mine / "edited.yaml").write_text(text)
    args, dirs = ["model=edited"], [tmp_path / "mine"]
    assert compose(args, dirs).model.emb_dim == 128
    parses.clear()
    (mine / "edited.yaml").write_text(text.replace("emb_dim: 128", "emb_dim: 256"))
    assert compose(args, dirs).model.emb_dim == 256
    assert [p for p in parses if p.endswith(".yaml")] == [str(mine / "edited.yaml")]


def test_a_file_that_does_not_load_fails_as_always_and_is_not_kept(
        tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine" / "model"
    mine.mkdir(parents=True)
    (mine / "broken.yaml").write_text("emb_dim: [128\n")
    args, dirs = ["model=broken"], [tmp_path / "mine"]
    with pytest.raises(ConfigError) as ours:
        compose(args, dirs)
    entries = kept(cache_home)
    with pytest.raises(ConfigError) as again:
        compose(args, dirs)
    monkeypatch.setenv("CAPIBARA_COMPOSE_CACHE", "0")
    with pytest.raises(ConfigError) as afresh:
        compose(args, dirs)
    assert str(ours.value) == str(again.value) == str(afresh.value)
    assert "broken.yaml" in str(ours.value)
    assert kept(cache_home) == entries


def test_an_unreadable_cache_is_as_if_there_were_none(cache_home: Path,
                                                      parses: list[str]) -> None:
    cache_home.parent.mkdir(parents=True)
    cache_home.write_bytes(b"not a pickle")
    assert compose([]).model.emb_dim == 128
    assert len(kept(cache_home)) >= 15  # written anew


def test_a_refused_command_keeps_nothing(cache_home: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.train_steps"):
        checks.compose_checked(flags.parse(["trainer.train_steps=-5"]), "config")
    with pytest.raises(ConfigError, match="model.emb_dm"):
        checks.compose_checked(flags.parse(["model.emb_dm=64"]), "config")
    assert not cache_home.exists()
    checks.compose_checked(flags.parse([]), "config")
    assert len(kept(cache_home)) >= 15  # what all three read


def test_switched_off_it_reads_and_keeps_nothing(cache_home: Path, parses: list[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    compose([])
    monkeypatch.setenv("CAPIBARA_COMPOSE_CACHE", "0")
    parses.clear()
    compose([])
    assert len(parses) >= 15
    cache_home.unlink()
    compose([])
    assert not cache_home.exists()
    assert parsed_cache.KEEP >= 2 * len(parses)  # room for conf/ and an edit or two
