"""The kept composition (cli/compose_cache.py): the same command line on the same files gives
the config Hydra composes, any change to what the composition reads composes afresh, and a
refused command keeps nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.cli import checks, compose_cache, flags
from capibara_exp.cli import compose as composing


@pytest.fixture(autouse=True)
def cache_home(capibara_cache: Path) -> Path:
    return capibara_cache / "compose"


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.pickle")) if cache.is_dir() else []


def checked(*args: str):
    return checks.compose_checked(flags.parse(list(args)), "config")[0]


def test_a_kept_composition_is_the_one_hydra_composes(cache_home: Path) -> None:
    args = ("experiment=dense_small_rope", "trainer.train_steps=7")
    fresh = checked(*args)
    assert len(entries(cache_home)) == 1
    again = checked(*args)
    assert again.cache_key == fresh.cache_key
    assert compose_cache.load(again.cache_key) is not None  # (what the second one read)
    assert OmegaConf.to_yaml(again.cfg) == OmegaConf.to_yaml(fresh.cfg)  # hydra node too
    uncached = composing.compose("config", list(args), [])
    assert OmegaConf.to_yaml(again.cfg) == OmegaConf.to_yaml(uncached.cfg)
    assert again.choices == fresh.choices and again.defaults == fresh.defaults
    assert OmegaConf.select(again.cfg, "trainer.train_steps") == 7


def test_an_edited_config_file_composes_again(tmp_path: Path, cache_home: Path) -> None:
    mine = tmp_path / "mine" / "model"
    mine.mkdir(parents=True)
    text = (CONF_DIR / "model" / "dense_tiny.yaml").read_text()
    (mine / "edited.yaml").write_text(text)
    args = ("--config-dir", str(tmp_path / "mine"), "model=edited")
    assert checked(*args).cfg.model.emb_dim == 128
    # the same size, the same second: only the contents differ
    (mine / "edited.yaml").write_text(text.replace("emb_dim: 128", "emb_dim: 256"))
    assert checked(*args).cfg.model.emb_dim == 256
    assert len(entries(cache_home)) == 2


def test_another_working_directory_is_another_entry(tmp_path: Path, cache_home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first = checked()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    second = checked()
    assert first.cache_key != second.cache_key
    assert second.cfg.hydra.runtime.cwd == str(tmp_path / "elsewhere")


def test_a_refused_command_keeps_nothing(cache_home: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.train_steps=-5"):
        checked("trainer.train_steps=-5")
    with pytest.raises(ConfigError, match="model.emb_dm"):
        checked("model.emb_dm=64")
    assert entries(cache_home) == []


def test_switched_off_it_keeps_nothing(cache_home: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPIBARA_COMPOSE_CACHE", "0")
    assert checked().cache_key is None
    assert entries(cache_home) == []


def test_an_unreadable_entry_is_composed_again(cache_home: Path) -> None:
    key = checked().cache_key
    (cache_home / f"{key}.pickle").write_bytes(b"not a pickle")
    assert checked().cfg.model.emb_dim == 128
    assert compose_cache.load(key) is not None  # written anew


TYPOS = [["model.emb_dm=64"], ["experiment=dense_small_rope", "trainer.train_steps=5",
                               "model.emb_dm=64"], ["model.nope.x=1"], ["nme=foo"],
         ["model.emb_dim=96", "optimizer.lr=1"]]


@pytest.mark.parametrize("args", TYPOS, ids=" ".join)
def test_a_key_typo_is_refused_from_the_kept_rest_of_the_line(
        args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the rest of the line kept composed, a key the config lacks is refused without
    composing again, in the words Hydra's refusal gets."""
    with pytest.raises(ConfigError) as hydras:
        composing.compose("config", args, [])  # not cached: Hydra composes and refuses
    checked(*[a for a in args if a.split("=")[0] in ("experiment",)])  # the rest, kept
    composed = []
    real = composing._hydra_compose
    monkeypatch.setattr(composing, "_hydra_compose", lambda *a: composed.append(a) or real(*a))
    with pytest.raises(ConfigError) as ours:
        checked(*args)
    assert str(ours.value) == str(hydras.value)
    assert composed == []


def test_without_the_rest_kept_or_under_a_value_hydra_composes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    composed = []
    real = composing._hydra_compose
    monkeypatch.setattr(composing, "_hydra_compose", lambda *a: composed.append(a) or real(*a))
    with pytest.raises(ConfigError, match="unknown key 'model.emb_dm'"):
        checked("model.emb_dm=64")  # nothing kept yet
    assert len(composed) == 1
    checked()  # the rest (nothing), kept
    assert checked("model.emb_dim=96", "trainer.train_steps=5").cfg.model.emb_dim == 96
    assert len(composed) == 2  # (the value line: from the kept rest, not composed)
    with pytest.raises(ConfigError, match="unknown key 'trainer.train_steps.x'"):
        checked("trainer.train_steps.x=1")  # under a value, not a mapping: Hydra's to say
    assert len(composed) == 3


def _spied(monkeypatch: pytest.MonkeyPatch) -> list:
    composed: list = []
    real = composing._hydra_compose
    monkeypatch.setattr(composing, "_hydra_compose", lambda *a: composed.append(a) or real(*a))
    return composed


def _same(ours, hydras) -> None:
    """The same config, hydra node, flags and records included."""
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydras)
    assert OmegaConf.is_struct(ours) and not OmegaConf.is_readonly(ours.hydra)
    for key in ("hydra.overrides.task", "hydra.overrides.hydra", "hydra.job.override_dirname",
                "hydra.runtime.choices"):
        assert OmegaConf.select(ours, key) == OmegaConf.select(hydras, key), key


VALUE_LINES = [  # (the rest, kept first; the whole line)
    ([], ["random_seed=3"]),
    ([], ["model.emb_dim=96", "trainer.train_steps=5", "name=x"]),
    (["experiment=dense_small_rope"],
     ["model.emb_dim=64", "experiment=dense_small_rope", "trainer.train_steps=9"]),
    (["ema=default", "hydra.job.chdir=true"],
     ["ema=default", "trainer.train_steps=9", "hydra.job.chdir=true", "ema.ema_decay=0.5"]),
]


@pytest.mark.parametrize(("rest", "line"), VALUE_LINES, ids=lambda a: " ".join(a))
def test_a_line_that_only_sets_values_is_hydras_composition_from_the_kept_rest(
        rest: list[str], line: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    hydras = composing.compose("config", line, []).cfg  # Hydra composes the whole line
    checked(*rest)
    composed = _spied(monkeypatch)
    ours = checked(*line)
    assert composed == []
    _same(ours.cfg, hydras)
    assert [str(o) for o in ours.cfg.hydra.overrides.task] == [
        o for o in line if not o.startswith("hydra.")]


def test_with_a_config_dir_the_kept_rest_is_that_search_paths(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    mine = tmp_path / "mine" / "model"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text((CONF_DIR / "model" / "dense_tiny.yaml").read_text())
    args = ["--config-dir", str(tmp_path / "mine"), "model=mine"]
    hydras = composing.compose("config", ["model=mine", "model.emb_dim=64"],
                               [tmp_path / "mine"]).cfg
    checked(*args)
    composed = _spied(monkeypatch)
    _same(checked(*args, "model.emb_dim=64").cfg, hydras)
    assert composed == []
    (mine / "mine.yaml").write_text("emb_dim: 1\n")  # an edit: the kept rest is stale
    with pytest.raises(ConfigError):
        checked(*args, "model.num_heads=2")
    assert len(composed) == 1


@pytest.mark.parametrize("line", [["~name", "random_seed=3"], ["random_seed=3", "+extra=1"],
                                  ["model={emb_dim: 64}", "random_seed=3"]], ids=" ".join)
def test_a_rest_that_sets_or_deletes_keys_is_composed_by_hydra(
        line: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Their order against the values matters (`k=v ~k`): Hydra applies the line."""
    rest = [a for a in line if a != "random_seed=3"]
    composing.keep(composing.compose("config", rest, [], cached=True))
    composed = _spied(monkeypatch)
    comp = composing.compose("config", line, [], cached=True)
    assert len(composed) == 1
    assert comp.cfg.random_seed == 3


def test_a_value_hydra_refuses_is_refused_in_hydras_words(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A key the config has, given a value Hydra's second step refuses (an unclosed
    interpolation): Hydra composes the line and says so."""
    line = ["random_seed=1", "model.emb_dim='${x'"]
    with pytest.raises(ConfigError) as hydras:
        composing.compose("config", line, [])
    checked()
    composed = _spied(monkeypatch)
    with pytest.raises(ConfigError) as ours:
        composing.compose("config", line, [], cached=True)
    assert str(ours.value) == str(hydras.value)
    assert "model.emb_dim" in str(ours.value) and len(composed) == 1


def test_a_key_under_a_missing_value_is_hydras_to_decide(tmp_path: Path) -> None:
    """`model.extra.b=1` where the kept config has `extra: ???`: not a plain mapping, Hydra
    composes and decides."""
    mine = tmp_path / "mine" / "model"
    mine.mkdir(parents=True)
    text = (CONF_DIR / "model" / "dense_tiny.yaml").read_text()
    (mine / "holey.yaml").write_text(text + "\nextra: ???\n")
    dirs, rest = [tmp_path / "mine"], ["model=holey"]
    with pytest.raises(ConfigError) as hydras:
        composing.compose("config", [*rest, "model.extra.b=1"], dirs)
    composing.keep(composing.compose("config", rest, dirs, cached=True))
    with pytest.raises(ConfigError) as ours:
        composing.compose("config", [*rest, "model.extra.b=1"], dirs, cached=True)
    assert str(ours.value) == str(hydras.value)
