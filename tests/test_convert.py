"""capibara-exp-convert: export -> import round trips bit for bit, tokenizers equal their
reference libraries, and every bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from capibara_exp.cli import convert as cli
from capibara_exp.convert import hf_export, hf_import, safetensors_io
from capibara_exp.runtime import checkpoints
from tests import console_lines, hf_reference

pytest.importorskip("transformers", reason="the reference implementation: pip install "
                    "'capibara-exp[reference]' (the test extra has it)")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # what the test's own set-up printed (transformers' progress)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out, out.err


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def tensors(directory: Path) -> dict[str, np.ndarray]:
    ckpt = safetensors_io.Checkpoint(directory)
    return {name: np.array(ckpt.tensor(name)) for name in ckpt.names()}


@pytest.mark.parametrize("family,scan", [("mixtral", False), ("gemma2", True), ("qwen2_5", False)])
def test_hf_to_checkpoint_to_hf_is_bitwise(family: str, scan: bool, tmp_path: Path) -> None:
    hf_dir = hf_reference.build_model(family, tmp_path / "hf", dtype="bfloat16")
    hf_reference.build_tokenizer(hf_dir)
    hf_import.import_model(hf_dir, tmp_path / "imported", name="m", scan_layers=scan)
    summary = hf_export.export_model(tmp_path / "imported", tmp_path / "exported",
                                     max_shard_bytes=20_000)  # several shards and an index
    assert summary["files"] > 1 and (tmp_path / "exported" / safetensors_io.INDEX).is_file()
    original, back = tensors(hf_dir), tensors(tmp_path / "exported")
    assert sorted(original) == sorted(back)
    for name, value in original.items():
        assert value.dtype == back[name].dtype and value.tobytes() == back[name].tobytes(), name
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "exported" / f).read_bytes() == (hf_dir / f).read_bytes()


def test_exported_directory_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    hf_dir = hf_reference.build_model("gemma3", tmp_path / "hf")
    hf_import.import_model(hf_dir, tmp_path / "imported", name="m")
    hf_export.export_model(tmp_path / "imported", tmp_path / "exported")
    tokens = np.random.default_rng(1).integers(1, 300, (2, 10))
    want, _ = hf_reference.reference_logits(hf_dir, tokens)
    got, _ = hf_reference.reference_logits(tmp_path / "exported", tokens)
    np.testing.assert_array_equal(got, want)


def test_checkpoint_to_hf_to_checkpoint_is_bitwise(tmp_path: Path) -> None:
    hf_dir = hf_reference.build_model("llama3", tmp_path / "hf")
    first = hf_import.import_model(hf_dir, tmp_path / "a", name="m")
    hf_export.export_model(tmp_path / "a", tmp_path / "hf2")
    second = hf_import.import_model(tmp_path / "hf2", tmp_path / "b", name="m")
    meta = checkpoints.tree_metadata(Path(first["checkpoint"]))
    paths = [p for p in meta if p[0] == "target"]
    a = checkpoints.read_leaves(Path(first["checkpoint"]), paths)
    b = checkpoints.read_leaves(Path(second["checkpoint"]), paths)
    for path in paths:
        assert a[path].dtype == b[path].dtype and a[path].tobytes() == b[path].tobytes(), path


def test_tokenizer_json_vocabulary_encodes_as_the_reference_tokenizer(tmp_path: Path) -> None:
    import tensorflow as tf
    import transformers

    from capibara_exp.data import vocabularies

    hf_reference.build_tokenizer(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    vocab = vocabularies.get("tokenizer_json", str(tmp_path / "tokenizer.json"))
    assert vocab.eos_id == reference.eos_token_id and vocab.vocab_size == len(reference)
    for text in [*hf_reference.TEXT, "unseen: ∮ E⋅da = Q, n → ∞ 🙂"]:
        want = reference(text, add_special_tokens=False)["input_ids"]
        assert list(vocab.encode(text)) == want
        assert vocab.encode_tf(tf.constant(text)).numpy().tolist() == want  # the tasks' path
        assert vocab.decode(want) == reference.decode(want)
    assert vocab == vocabularies.TokenizerJsonVocabulary(tmp_path / "tokenizer.json")


def test_sentencepiece_trained_on_the_corpus_encodes_as_sentencepiece(tmp_path: Path,
                                                                     data_dir: Path) -> None:
    import sentencepiece as spm
    import tensorflow as tf

    from capibara_exp.data import sentencepiece_model, vocabularies

    report = sentencepiece_model.train(tmp_path / "c.model", data_dir, vocab_size=1000)
    assert report["tokens_per_byte"] < report["byte_vocabulary_tokens_per_byte"]
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "c.model"))
    vocab = vocabularies.get("sentencepiece", str(tmp_path / "c.model"))
    assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    for text in hf_reference.TEXT:
        want = reference.encode(text)
        assert list(vocab.encode(text)) == want
        assert vocab.encode_tf(tf.constant(text)).numpy().tolist() == want
        assert vocab.decode(want) == text  # byte fallback: every string comes back


def _bad_model_dir(tmp_path: Path, how: str) -> tuple[Path, str]:
    hf_dir = hf_reference.build_model("qwen3", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    if how == "architecture":
        config["architectures"] = ["FalconForCausalLM"]
        (hf_dir / "config.json").write_text(json.dumps(config))
        return hf_dir, "FalconForCausalLM"
    original = tensors(hf_dir)
    if how == "missing":
        original.pop("model.layers.1.mlp.up_proj.weight")
        expected = "model.layers.1.mlp.up_proj.weight is missing"
    elif how == "extra":
        original["model.layers.9.mlp.up_proj.weight"] = original["model.norm.weight"]
        expected = "model.layers.9.mlp.up_proj.weight is not part of the model"
    else:
        original["model.norm.weight"] = np.zeros(31, np.float32)
        expected = "model.safetensors: tensor model.norm.weight has shape [31]"
    planned = [(k, v.shape, v.dtype, lambda v=v: v) for k, v in original.items()]
    list(safetensors_io.write_file(hf_dir / safetensors_io.SINGLE, planned))
    return hf_dir, expected


@pytest.mark.parametrize("how", ["architecture", "missing", "extra", "shape"])
def test_a_model_directory_that_does_not_fit_is_refused_in_one_line(
        how: str, tmp_path: Path, capsys) -> None:
    hf_dir, expected = _bad_model_dir(tmp_path, how)
    before = tree_digest(hf_dir)
    code, out, err = run_cli(["import", f"hf_dir={hf_dir}", f"out={tmp_path / 'out'}"], capsys)
    # config.json is read before the first line; the tensors after it (progress lines first)
    lines = err.strip().splitlines() if how == "architecture" else console_lines.error_lines(err)
    assert code == 2 and expected in err and len(lines) == 1, err
    assert not (tmp_path / "out").exists() and tree_digest(hf_dir) == before
    assert not list(tmp_path.glob("out.importing-*"))


@pytest.mark.parametrize("argv,expected", [
    (["import", "hf_dir=/nonexistent", "out=x"], "hf_dir=/nonexistent: no such file"),
    (["import", "out=x"], "missing hf_dir=..."),
    (["export", "checkpoint=/nonexistent", "out=y"], "checkpoint=/nonexistent: no such file"),
    (["sentencepiece", "out=m.txt"], "ends in .model"),
    (["convert", "a=b"], "unknown command 'convert'"),
    (["import", "hf_dir=a", "out="], "is not key=value with a value"),
])
def test_bad_command_lines_are_one_line_and_exit_2(argv, expected, capsys, tmp_path,
                                                   monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_import_into_a_non_empty_directory_is_refused(tmp_path: Path, capsys) -> None:
    hf_dir = hf_reference.build_model("llama3", tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, _, err = run_cli(["import", f"hf_dir={hf_dir}", f"out={tmp_path / 'out'}"], capsys)
    assert code == 2 and "exists and is not empty" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_export_of_the_t5_style_decoder_names_why(tmp_path: Path) -> None:
    from capibara_exp.base.errors import ConfigError

    with pytest.raises(ConfigError, match="position_embedding=relative"):
        hf_export.family_for(hf_export.compose_entry("dense_tiny"))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_kernels_transpose_as_numpy_transposes_them(dtype: str) -> None:
    rng = np.random.default_rng(0)
    for shape in [(5, 3), (7, 24), (40, 64), (33, 130), (1, 16), (16, 1), (0, 8)]:
        x = (rng.standard_normal(shape) * 10).astype(dtype)
        if x.size:
            x.reshape(-1)[:: 7] = np.nan  # NaN bits move as they are
        for tile in (2, 3, 128):  # bands and tiles that do and do not divide the shape
            got = safetensors_io.transposed(x, tile)
            want = np.ascontiguousarray(x.T)
            assert got.dtype == x.dtype and got.shape == want.shape and got.flags.c_contiguous
            assert got.tobytes() == want.tobytes(), (shape, tile)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_the_nan_check_agrees_with_numpys_isfinite(dtype: str) -> None:
    from capibara_exp.convert import t5x_writer

    x = np.random.default_rng(1).standard_normal(100).astype(dtype)
    assert t5x_writer.finite(x, block=7) and t5x_writer.finite(x.reshape(10, 10))
    for where in (0, 6, 7, 50, 99):  # at, before and after block edges
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[where] = bad
            assert t5x_writer.finite(y, block=7) == bool(np.isfinite(y.astype(np.float64)).all())
            assert not t5x_writer.finite(y, block=7)
    import ml_dtypes

    largest = ml_dtypes.finfo(dtype).max
    assert t5x_writer.finite(np.array([largest, -largest], dtype))


def test_the_write_budget_holds_back_what_does_not_fit() -> None:
    import asyncio

    from capibara_exp.convert import t5x_writer

    async def scenario() -> list[str]:
        budget, events = t5x_writer._Budget(10), []

        async def take(name: str, n: int) -> None:
            await budget.take(n)
            events.append(f"took {name}")

        await take("a", 6)
        waiting = asyncio.ensure_future(take("b", 6))  # 12 > 10: waits for a
        await asyncio.sleep(0)
        events.append("a written")
        await budget.give(6)
        await waiting
        await budget.give(6)
        await take("huge", 25)  # larger than the budget: goes alone
        return events

    assert asyncio.run(scenario()) == ["took a", "a written", "took b", "took huge"]


def test_a_nan_in_the_weights_is_refused_naming_the_tensor(tmp_path: Path, capsys) -> None:
    hf_dir = hf_reference.build_model("llama3", tmp_path / "hf")
    original = tensors(hf_dir)
    original["model.layers.1.mlp.up_proj.weight"].reshape(-1)[5] = np.nan
    planned = [(k, v.shape, v.dtype, lambda v=v: v) for k, v in original.items()]
    list(safetensors_io.write_file(hf_dir / safetensors_io.SINGLE, planned))
    code, _, err = run_cli(["import", f"hf_dir={hf_dir}", f"out={tmp_path / 'out'}"], capsys)
    # found while writing, after the first line: progress lines, then the one refusal
    assert code == 2 and len(console_lines.error_lines(err)) == 1, err
    assert "model.safetensors: tensor model.layers.1.mlp.up_proj.weight holds NaN" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.importing-*"))
