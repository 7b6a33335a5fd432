"""`capibara-exp-convert import`: a Hugging Face model directory into a T5X-layout checkpoint
and a conf/model entry.

Everything is checked before anything is written: the architecture (families.py), every
tensor the model needs (present, of the right shape, a float dtype) and none it does not
(tensor_names.py). Then OUT/checkpoint_0 is written as the tensors are read (t5x_writer.py:
reading, transposing and writing overlap; host memory is a few tensors, not the model),
with the tokenizer's files in OUT/tokenizer/, the model entry in
OUT/conf/model/<name>.yaml and what was imported in OUT/import.json. The whole of OUT
appears at once (written beside it, then renamed), so a refused or interrupted import
leaves nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from flax import traverse_util

from capibara_exp.base import phases
from capibara_exp.base.errors import ConfigError
from capibara_exp.convert import families, safetensors_io, t5x_writer, tensor_names
from capibara_exp.convert.network import network
from capibara_exp.runtime import checkpoints

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json", "config.json")
# Buffers some checkpoints carry that are not weights (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
RECORD = "import.json"


def param_shapes(model: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The network's parameters by path and shape (traced, never computed)."""
    tokens = jax.ShapeDtypeStruct((1, 128), np.int32)  # (splash's smallest block)
    net = network(model)
    shapes = jax.eval_shape(lambda t: net.init(jax.random.PRNGKey(0), t, t,
                                               enable_dropout=False), tokens)["params"]
    flat = traverse_util.flatten_dict(dict(shapes), sep="/")
    return {k: tuple(v.shape) for k, v in flat.items()}


def _expected(entry: tensor_names.Entry, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The HF tensors of an entry and the shape each must have, from the parameter's."""
    return {name: entry.hf_shape(shape) for name in entry.names()}


def check_tensors(ckpt: safetensors_io.Checkpoint, entries: list[tensor_names.Entry],
                  shapes: Mapping[str, tuple[int, ...]], hf_dir: Path) -> None:
    """Every tensor the model needs, of the right shape and a float dtype; none extra."""
    wanted: dict[str, tuple[int, ...]] = {}
    for entry in entries:
        wanted.update(_expected(entry, shapes[entry.path]))
    have = set(ckpt.names())
    for name, shape in wanted.items():
        if name not in have:
            raise ConfigError(f"{hf_dir}: tensor {name} is missing (the model needs it)")
        where = ckpt.where[name].path.name
        if ckpt.shape(name) != shape:
            raise ConfigError(f"{hf_dir / where}: tensor {name} has shape "
                              f"{list(ckpt.shape(name))}, the model needs {list(shape)}")
        if ckpt.dtype(name) not in safetensors_io.FLOATS:
            raise ConfigError(f"{hf_dir / where}: tensor {name} is {ckpt.dtype(name)}, not a "
                              "float (quantized checkpoints are not imported)")
    for name in sorted(have - set(wanted)):
        if name.endswith(IGNORED_SUFFIXES) or _tied_copy(ckpt, name, wanted):
            continue
        raise ConfigError(f"{hf_dir / ckpt.where[name].path.name}: tensor {name} is not part "
                          "of the model this config.json describes")


def _tied_copy(ckpt: safetensors_io.Checkpoint, name: str, wanted: Mapping) -> bool:
    """A tied model's lm_head saved anyway: harmless when it equals the embedding."""
    embed = "model.embed_tokens.weight"
    return name == "lm_head.weight" and embed in wanted and np.array_equal(
        ckpt.tensor(name), ckpt.tensor(embed))


def lazy_leaf(ckpt: safetensors_io.Checkpoint, entry: tensor_names.Entry,
              shape: tuple[int, ...]) -> t5x_writer.Leaf:
    hf_names = entry.names()
    first = hf_names[0]

    def load(sources: Any) -> np.ndarray:
        if isinstance(sources, str):
            x = ckpt.mapped(sources)  # (the transpose, or the write, reads the pages)
            return safetensors_io.transposed(x) if entry.transpose else x
        return np.stack([load(s) for s in sources])

    make: Callable[[], np.ndarray] = lambda: load(entry.sources)  # noqa: E731
    what = (f"tensor {first}" if len(hf_names) == 1 else
            f"tensors {first} ... {hf_names[-1]} (stacked into {entry.path})")
    return t5x_writer.Leaf(shape, ckpt.dtype(first), make, f"{ckpt.where[first].path}: {what}")


def _model_entry(fam: families.Family, keys: Mapping[str, Any], source: Path, name: str,
                 tokenizer: tuple[str, str | None]) -> str:
    base = {"llama3": "llama3_8b", "mistral": "mistral_7b", "qwen2_5": "qwen2_5_7b",
            "qwen3": "qwen3_8b", "gemma2": "gemma2_9b", "gemma3": "gemma3_4b",
            "mixtral": "mixtral_8x7b", "qwen3_moe": "qwen3_moe_30b_a3b"}[fam.name]
    lines = [f"# {fam.architecture} imported by capibara-exp-convert from {source}",
             f"# ({time.strftime('%Y-%m-%d')}); its weights: the checkpoint_0 beside conf/.",
             "defaults:", f"  - {base}", "  - _self_",
             f"vocabulary: {tokenizer[0]}", f"vocabulary_path: {json.dumps(tokenizer[1])}"]
    body = yaml.safe_dump(dict(keys), sort_keys=False, default_flow_style=None, width=100)
    return "\n".join(lines) + "\n" + body


def _tokenizer(hf_dir: Path, out: Path, vocab_size: int) -> tuple[str, str | None]:
    """Copy the tokenizer's files; the model entry's vocabulary and its path."""
    found = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
    (out / "tokenizer").mkdir()
    for f in found:
        shutil.copyfile(hf_dir / f, out / "tokenizer" / f)
    final = out.with_name(out.name.split(".importing-")[0]) / "tokenizer"
    if "tokenizer.json" in found:
        return "tokenizer_json", str(final / "tokenizer.json")
    if "tokenizer.model" in found:
        return "sentencepiece", str(final / "tokenizer.model")
    if vocab_size >= 259:  # a model without a tokenizer (tests'): bytes fit its embedding
        return "byte", None
    return "???", None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def import_model(hf_dir: str | Path, out: str | Path, name: str | None = None,
                 scan_layers: bool = False, compute_dtype: str | None = None) -> dict:
    """Import hf_dir into out (new or empty); returns what import.json records."""
    hf_dir, out = Path(hf_dir).expanduser().absolute(), Path(out).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out={out}: exists and is not an empty directory")
    config = families.read_config(hf_dir)
    fam, keys = families.model_keys(config, str(hf_dir / "config.json"))
    keys["scan_layers"] = bool(scan_layers)
    source_dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    keys["dtype"] = compute_dtype or ("float32" if source_dtype == "float32" else "bfloat16")
    name = name or _entry_name(hf_dir)
    ckpt = safetensors_io.Checkpoint(hf_dir)
    entries = tensor_names.entries(fam, keys)
    with phases.phase("checking the model's tensors"):
        try:
            shapes = param_shapes(keys)
        except ValueError as err:  # a config the networks refuse (nets.DecoderConfig's checks)
            raise ConfigError(f"{hf_dir / 'config.json'}: {err}") from None
        check_tensors(ckpt, entries, shapes, hf_dir)
    staging = out.with_name(f"{out.name}.importing-{os.getpid()}")
    try:
        return _write(staging, out, fam, keys, name, config, ckpt, entries, shapes, hf_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _entry_name(hf_dir: Path) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in hf_dir.name.lower()).strip("_")
    return cleaned or "imported"


def _write(staging: Path, out: Path, fam, keys, name, config, ckpt, entries, shapes,
           hf_dir) -> dict:
    staging.mkdir(parents=True)
    tree = {"state": {"step": np.asarray(0, np.int32)},
            "target": traverse_util.unflatten_dict(
                {e.path: lazy_leaf(ckpt, e, shapes[e.path]) for e in entries}, sep="/")}
    with phases.phase(f"writing {len(entries)} parameters"):
        try:
            t5x_writer.save(staging, 0, tree, kind="import")
        except checkpoints.NonFiniteState as err:  # bad input: one line, nothing written
            raise ConfigError(str(err)) from None
    tokenizer = _tokenizer(hf_dir, staging, keys["vocab_size"])
    (staging / "conf" / "model").mkdir(parents=True)
    (staging / "conf" / "model" / f"{name}.yaml").write_text(
        _model_entry(fam, keys, hf_dir, name, tokenizer))
    total = sum(int(np.prod(s)) for s in shapes.values())
    record = {"source": str(hf_dir), "architecture": fam.architecture, "family": fam.name,
              "config_sha256": _digest(hf_dir / "config.json"), "model_entry": name,
              "parameters": total, "scan_layers": keys["scan_layers"],
              "dtypes": sorted({str(ckpt.dtype(n)) for e in entries for n in e.names()}),
              "vocabulary": tokenizer[0], "checkpoint": str(out / "checkpoint_0"),
              "config": {k: v for k, v in config.items() if not isinstance(v, dict | list)}}
    (staging / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked first)
    staging.rename(out)
    return record
