"""The gin bridge: literals, templates, engines, golden output, and loud errors."""

from __future__ import annotations

import glob
import math
import os
import tomllib
from pathlib import Path

import gin
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import GIN_DIR
from capibara_exp.composing import gin_bridge
from capibara_exp.composing.gin_bridge import GinReference, to_gin_literal
from capibara_exp.runtime import gin_utils
from tests.conftest import EXPERIMENTS, compose_config

GOLDEN = Path(__file__).parent / "golden" / "dense_tiny_lm.local.gin"
UPDATE_GOLDEN = "CAPIBARA_UPDATE_GOLDEN"
REPO = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- literals

# Strings shaped like references (@name, %MACRO) render as references by design: not literals.
plain_text = st.text(max_size=30).filter(lambda s: not gin_bridge._REFERENCE_RE.match(s))
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63)
           | st.floats(allow_nan=False, allow_infinity=False) | plain_text)
keys = st.text(max_size=10) | st.integers(min_value=-1000, max_value=1000)
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                   | st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12)


def _parse_back(literal: str) -> object:
    gin.clear_config(clear_constants=True)
    gin.parse_config(f"VALUE = {literal}")
    return gin.query_parameter("%VALUE")


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(values)
def test_literal_round_trips_through_gin(value: object) -> None:
    assert _same(_parse_back(to_gin_literal(value)), value), to_gin_literal(value)


@pytest.mark.parametrize("value, text", [
    (1e-4, "0.0001"), (3e-10, "3e-10"), (True, "True"), (None, "None"), ("it's", '"it\'s"'),
    ((1,), "(1,)"), ((), "()"), ([1, "a"], "[1, 'a']"), ({"targets": 128}, "{'targets': 128}"),
    ("@nets.Decoder()", "@nets.Decoder()"), ("@trainer.Trainer", "@trainer.Trainer"),
    ("%MODEL_DIR", "%MODEL_DIR"), ("@ not a ref", "'@ not a ref'"),
])
def test_literal_text(value: object, text: str) -> None:
    assert to_gin_literal(value) == text


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), object(), {1.5: 2}])
def test_unrepresentable_values_are_errors(bad: object) -> None:
    with pytest.raises(ConfigError, match="where"):
        to_gin_literal(bad, where="where")


def test_reference_strings_parse_as_references() -> None:
    gin.clear_config(clear_constants=True)
    gin.parse_config(f"A = 3\nB = {to_gin_literal(GinReference('%A'))}")
    assert repr(gin.query_parameter("%B")) == "%A"


# ----------------------------------------------------------------------------- configs

@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
@pytest.mark.parametrize("engine", ["local", "t5x"])
def test_every_experiment_composes_bridges_and_parses(experiment: str | None, engine: str,
                                                      tmp_path: Path) -> None:
    overrides = [f"engine={engine}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = compose_config(overrides)
    try:
        text = gin_bridge.render(cfg, engine, GIN_DIR)
    except ConfigError as err:  # only the local engine's own features may refuse engine=t5x
        assert engine != "local" and "the local engine's own feature" in str(err), err
        return
    assert text.startswith(f"# config.gin rendered by capibara-exp for engine={engine}.")
    assert gin_bridge.header(engine) in text
    # The body is engine-independent: check it against the local engine's configurables.
    local = gin_bridge.header("local") + gin_bridge.BODY_MARKER + gin_bridge.body_of(text)
    gin_utils.parse(tmp_path / "config.gin", local)
    assert gin.query_parameter("%MODEL_DIR") == "/tmp/capibara-model"


@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_engine_bodies_are_identical(experiment: str | None) -> None:
    cfg = compose_config([f"experiment={experiment}"] if experiment else [])
    local, t5x = (gin_bridge.render(cfg, e, GIN_DIR) for e in ("local", "t5x"))
    assert local != t5x  # the headers differ...
    assert gin_bridge.body_of(local) == gin_bridge.body_of(t5x)  # ...and nothing else
    assert "from t5x import utils" in t5x and "import __main__ as train_script" in t5x


def test_headers_bind_the_same_aliases() -> None:
    def aliases(engine: str) -> list[str]:
        return sorted(line.split()[-1] for line in gin_bridge.header(engine).splitlines())
    assert aliases("local") == aliases("t5x")


def test_default_experiment_matches_golden_gin() -> None:
    text = gin_bridge.render(compose_config(), "local", GIN_DIR)
    if os.environ.get(UPDATE_GOLDEN) == "1":  # regenerate on request only; review the diff
        GOLDEN.write_text(text)
    assert GOLDEN.is_file(), f"{GOLDEN} is missing: run with {UPDATE_GOLDEN}=1 to write it"
    assert text == GOLDEN.read_text(), (
        "config.gin of the default experiment changed. If the change to conf/ or gin/ is "
        f"intended, re-run with {UPDATE_GOLDEN}=1 to regenerate {GOLDEN.name}, then review "
        "the diff.")


@pytest.mark.parametrize("packing", [None, "seqio", "next_fit"])
def test_default_data_packing_is_a_conf_key(packing: str | None, tmp_path: Path) -> None:
    """data.packing picks the local engine's packer for the default task too (first_fit
    unless told), passed to the input pipeline in the DatasetConfigs the local engine's gin
    edge builds; T5X packs with seqio and ignores it."""
    from capibara_exp.data.packing import Packer
    from capibara_exp.runtime import utils

    cfg = compose_config([f"data.packing={packing}"] if packing else [])
    text = gin_bridge.render(cfg, "local", GIN_DIR)
    assert f"PACKING = '{packing or 'first_fit'}'  # data.packing" in text
    gin_utils.parse(tmp_path / "config.gin", text)
    for scope in ("train", "train_eval"):
        with gin.config_scope(scope):
            dataset_cfg = gin.get_configurable(utils.DatasetConfig)()
        assert dataset_cfg.packer == Packer(packing or "first_fit"), scope
    assert gin.query_parameter("train/utils.DatasetConfig.pack") is not None


def _shipped_files() -> set[str]:
    """Repo-relative paths pyproject.toml's package-data ships, its globs expanded as
    setuptools expands them (from each package's folder)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set()
    for package, globs in data.get("package-data", {}).items():
        folder = package.replace(".", "/")
        for g in globs:
            shipped |= {f"{folder}/{Path(f).as_posix()}"
                        for f in glob.glob(g, root_dir=REPO / folder, recursive=True)}
    return shipped


@pytest.mark.parametrize("top, suffixes", [
    ("capibara_exp/conf", (".yaml",)), ("capibara_exp/gin", (".gin",)),
    ("capibara_exp/sweeping/conf/sweeps", (".yaml",)),
    ("capibara_exp/kernels", (".pyx", ".pxd"))])
def test_installed_package_ships_every_config_file(top: str, suffixes: tuple[str, ...]) -> None:
    """pyproject's package-data must cover every shipped file, or an installed capibara-exp
    cannot find its conf/ and gin/ (tests run from the checkout and would not notice)."""
    files = {p.relative_to(REPO).as_posix() for p in (REPO / top).rglob("*")
             if p.suffix in suffixes}
    assert files
    missed = sorted(files - _shipped_files())
    assert not missed, f"pyproject.toml package-data misses {missed}"


def test_scoped_bindings_and_references_resolve(tmp_path: Path) -> None:
    gin_utils.parse(tmp_path / "config.gin", gin_bridge.render(compose_config(), "local", GIN_DIR))
    assert gin.query_parameter("train/utils.DatasetConfig.split") == "train"
    assert gin.query_parameter("train_eval/utils.DatasetConfig.split") == "validation"
    assert repr(gin.query_parameter("trainer.Trainer.num_microbatches")) == "%NUM_MICROBATCHES"
    assert repr(gin.query_parameter("train_script.train.trainer_cls")) == "@trainer.Trainer"


# ----------------------------------------------------------------------------- bad input

def test_unknown_key_in_a_group_names_key_and_file() -> None:
    cfg = compose_config(["+model.emb_dimension=64"])
    with pytest.raises(ConfigError, match=r"unknown key 'model.emb_dimension'.*dense_tiny.yaml"):
        gin_bridge.render(cfg, "local", GIN_DIR, {"model": "conf/model/dense_tiny.yaml"})


def test_missing_mandatory_value_names_key() -> None:
    cfg = compose_config(["model.emb_dim=???"])
    with pytest.raises(ConfigError, match=r"missing mandatory value.*model.emb_dim"):
        gin_bridge.render(cfg, "local", GIN_DIR)


def test_required_macro_without_value_names_template_and_key() -> None:
    cfg = compose_config(["~model.mlp_dim"])
    want = r"gin/models/decoder_only.gin requires MLP_DIM: set model.mlp_dim"
    with pytest.raises(ConfigError, match=want):
        gin_bridge.render(cfg, "local", GIN_DIR)


def test_missing_template_is_an_error() -> None:
    cfg = compose_config(["model.template=models/nope.gin"])
    with pytest.raises(ConfigError, match=r"model.template: gin template gin/models/nope.gin"):
        gin_bridge.render(cfg, "local", GIN_DIR)


@pytest.mark.parametrize("binding, pattern", [
    ("['nets.DecoderConfg.emb_dim = 3']",
     r"config.gin:\d+ \(from gin_bindings\[0\], nets.DecoderConfg.emb_dim\).*DecoderConfg"),
    ("['nets.DecoderConfig.dropout_rate = 0.0', 'nets.DecoderConfig.embed_dimension = 3']",
     r"config.gin:\d+ \(from gin_bindings\[1\], nets.DecoderConfig.embed_dimension\)"),
    ("['nets.DecoderConfig.emb_dim = [1,', 'nets.DecoderConfig.dropout_rate = 0.0']",
     r"config.gin:\d+: gin_bindings\[0\] \(nets.DecoderConfig.emb_dim\): EOF in multi-line"),
    ("['nets.DecoderConfig.dropout_rate = 0.0', 'nets.DecoderConfig.mlp_activations = [gelu]']",
     r"(?s)config.gin:\d+: gin_bindings\[1\] \(nets.DecoderConfig.mlp_activations\): .*'gelu'"),
])
def test_gin_typos_name_line_and_origin(binding: str, pattern: str, tmp_path: Path) -> None:
    cfg = compose_config([f"gin_bindings={binding}"])
    with pytest.raises(ConfigError, match=pattern):
        gin_utils.parse(tmp_path / "config.gin", gin_bridge.render(cfg, "local", GIN_DIR))


def test_unparsable_template_names_template(tmp_path: Path) -> None:
    templates = tmp_path / "gin"
    for path in GIN_DIR.rglob("*.gin"):
        target = templates / path.relative_to(GIN_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    broken = templates / "optimizers" / "adamw.gin"
    broken.write_text(broken.read_text() + "\noptax.adamw.b1 = )\n")
    text = gin_bridge.render(compose_config(), "local", templates)
    with pytest.raises(ConfigError, match=r"config.gin:\d+ \(from gin/optimizers/adamw.gin\)"):
        gin_utils.parse(tmp_path / "config.gin", text)


def test_bad_gin_binding_key_is_an_error() -> None:
    cfg = compose_config(["gin_bindings=['not a key = 3']"])
    with pytest.raises(ConfigError, match=r"gin_bindings\[0\].*not a gin binding"):
        gin_bridge.render(cfg, "local", GIN_DIR)


def test_include_cycle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.gin").write_text("include 'b.gin'\n")
    (tmp_path / "b.gin").write_text("include 'a.gin'\n")
    with pytest.raises(ConfigError, match="include cycle"):
        gin_bridge.load_template("a.gin", "model", tmp_path)


def test_includes_are_inlined_once_with_their_required_macros(tmp_path: Path) -> None:
    (tmp_path / "base.gin").write_text("X = %gin.REQUIRED\n")
    (tmp_path / "top.gin").write_text("include 'base.gin'\nY = %gin.REQUIRED\n")
    template = gin_bridge.load_template("top.gin", "model", tmp_path)
    assert template.required == ("X", "Y")
    assert "included from gin/top.gin:1" in template.text


def test_actions_of_several_templates_are_joined_not_overwritten(tmp_path: Path) -> None:
    """gin keeps only the last binding of a parameter: the bridge joins the actions."""
    cfg = compose_config(["early_stopping=default", "consensus=last_k"])
    text = gin_bridge.render(cfg, "local", GIN_DIR)
    assert text.count("train_script.train.actions =") == 1
    assert ("train_script.train.actions = {'TRAIN_EVAL': [%TRAIN_EVAL_ACTION_CHECKSUMS, "
            "%TRAIN_EVAL_ACTION_EARLY_STOPPING, %TRAIN_EVAL_ACTION_CONSENSUS]}") in text
    (tmp_path / "config.gin").write_text(text)
    gin_utils.parse(tmp_path / "config.gin", text)
    actions = gin.get_bindings("train_script.train")["actions"]["TRAIN_EVAL"]
    assert [type(a).__name__ for a in actions] == ["ChecksumCheckpoints", "EarlyStoppingAction",
                                                   "ConsensusMerge"]


def test_a_template_binding_actions_itself_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mine.gin").write_text(
        "train_script.train.actions = {'TRAIN_EVAL': []}\n")
    template = gin_bridge.load_template("runs/mine.gin", "trainer", tmp_path)
    with pytest.raises(ConfigError, match="gin/runs/mine.gin binds train_script.train.actions"):
        gin_bridge._check_actions([template])
