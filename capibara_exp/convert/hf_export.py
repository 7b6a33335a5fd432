"""`capibara-exp-convert export`: a checkpoint (trained, merged, LoRA-exported or imported)
into a Hugging Face model directory: config.json, safetensors weights (sharded with an index
past `max_shard_bytes`) and the model's tokenizer files.

The model is named by a conf/model entry (`model=`) or found beside the checkpoint: the
values a run's config.gin rendered (or its Hydra config), an import's
conf/model/<entry>.yaml, or the run a LoRA export or a merge came from. Its family follows
from its options (or `family=`); a model whose options no published family has (T5's
relative positions, say) is refused by name. Tensors are read from the checkpoint one
parameter at a time (tensorstore, with Orbax's spec for each array) and streamed into the
files in the checkpoint's dtype (or `dtype=`), the next tensor made while one is written;
OUT is written beside its final name and renamed when complete.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
import yaml
from etils import epath

from capibara_exp.base import phases
from capibara_exp.base.errors import ConfigError
from capibara_exp.convert import families, safetensors_io, tensor_names
from capibara_exp.convert.hf_import import TOKENIZER_FILES, param_shapes
from capibara_exp.runtime import checkpoints

DEFAULT_SHARD_BYTES = 5 * 2**30


def family_for(model: Mapping[str, Any]) -> families.Family:
    """The published family whose options a model has; a ConfigError when none has them."""
    if model.get("position_embedding") != "rope":
        raise ConfigError("this model uses position_embedding=relative (T5's bias, the "
                          "project's own decoder): no Hugging Face family has it")
    moe = bool(model.get("num_experts"))
    if model.get("norm_placement") == "pre_post":
        name = "gemma3" if model.get("qk_norm") else "gemma2"
    elif moe:
        name = "qwen3_moe" if model.get("qk_norm") else "mixtral"
    elif model.get("qkv_bias"):
        name = "qwen2_5"
    elif model.get("qk_norm"):
        name = "qwen3"
    else:
        name = "mistral" if model.get("sliding_window") else "llama3"
    fam = families.BY_NAME[name]
    check_family(fam, model)
    return fam


def check_family(fam: families.Family, model: Mapping[str, Any]) -> None:
    """The model's options must be the family's: fixed options equal, a MoE as its family
    computes it (every layer, dropless); otherwise the export would describe another model."""
    for key, value in fam.fixed.items():
        if key in model and model[key] != value and key != "logits_via_embedding":
            raise ConfigError(f"model.{key}={model[key]!r}: {fam.architecture} has {value!r}")
    if fam.moe and (model.get("moe_layer_interval") != 1 or not model.get("dropless")):
        raise ConfigError(f"{fam.architecture} has experts in every layer, dropless "
                          "(model.moe_layer_interval=1, model.dropless=true)")
    if len(model.get("mlp_activations", ())) != 2 or model["mlp_activations"][1] != "linear":
        raise ConfigError(f"model.mlp_activations={list(model['mlp_activations'])}: "
                          f"{fam.architecture} has a gated MLP [activation, linear]")
    if model.get("query_pre_attn_scalar") is None:
        raise ConfigError("model.query_pre_attn_scalar=null (T5's unscaled scores): every "
                          "published family scales them")


_VALUE_RE = re.compile(r"^([A-Z][A-Z0-9_]*) = (.+?)  # model\.(\w+)$")
_BINDING_RE = re.compile(r"^([A-Z][A-Z0-9_]*) = (.+)$")


def model_of_gin(path: Path) -> dict | None:
    """The `model` group a run trained, from its rendered config.gin: each model key's macro
    line, then any later binding of the same macro (gin_bindings, --gin.X flags)."""
    keys: dict[str, Any] = {}
    macros: dict[str, str] = {}
    for line in path.read_text().splitlines():
        found = _VALUE_RE.match(line)
        if found:
            macros[found.group(1)] = found.group(3)
            keys[found.group(3)] = _literal(found.group(2))
            continue
        bound = _BINDING_RE.match(line.strip())
        if bound and bound.group(1) in macros:
            keys[macros[bound.group(1)]] = _literal(bound.group(2))
    return keys or None


def _literal(text: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return list(value) if isinstance(value, tuple) else value


def model_of_dir(directory: Path) -> dict | None:
    if (directory / "config.gin").is_file():  # a run (either engine, however started)
        return model_of_gin(directory / "config.gin")
    hydra = directory / ".hydra" / "config.yaml"
    if hydra.is_file():
        return yaml.safe_load(hydra.read_text()).get("model")
    entries = sorted((directory / "conf" / "model").glob("*.yaml"))
    if len(entries) == 1:
        return compose_entry(entries[0].stem, str(directory / "conf"))
    for record, source in (("lora_export.json", lambda r: r["lora_run"]),
                           ("merge_report.json", lambda r: Path(
                               r["candidates"][0]["checkpoint"]).parent)):
        if (directory / record).is_file():  # a LoRA export or a merge: its source run's
            try:
                return model_of_dir(Path(source(json.loads((directory / record).read_text()))))
            except (KeyError, IndexError, TypeError, ValueError):
                return None
    return None


def compose_entry(entry: str, config_dir: str | None = None) -> dict:
    """The `model` group of `model=<entry>` composed as capibara-exp composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.composing.resolvers import register_resolvers

    register_resolvers()
    overrides = [f"model={entry}"]
    if config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(config_dir).absolute()}]")
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except Exception as err:  # Hydra's composition errors: one line naming the entry
        raise ConfigError(f"model={entry}: {str(err).splitlines()[0]}") from None
    return OmegaConf.to_container(cfg.model, resolve=True)


def locate(checkpoint: str | Path) -> Path:
    """A checkpoint_<step> dir as given, or a directory's latest one."""
    path = Path(checkpoint).expanduser().absolute()
    if path.name.startswith(checkpoints.STEP_PREFIX + "_") and (path / checkpoints.ITEM).is_dir():
        return path
    found = checkpoints.steps(path)
    if not found:
        raise ConfigError(f"checkpoint={checkpoint}: no checkpoint_<step>/{checkpoints.ITEM} "
                          "in it (a run's model dir, an import or a checkpoint_<step> dir)")
    return path / f"{checkpoints.STEP_PREFIX}_{found[-1]}"


def _planned(fam, model, step_dir: Path, dtype: str | None) -> list[safetensors_io.Planned]:
    """Every HF tensor: name, shape, dtype and how to read it, in the order that reads each
    checkpoint parameter once (a stacked parameter gives its slices one after another)."""
    meta = checkpoints.tree_metadata(step_dir)
    shapes = param_shapes(model)
    read = LeafReader(meta)
    cache: dict[str, np.ndarray] = {}

    def leaf(path: str) -> np.ndarray:
        if path not in cache:
            cache.clear()
            cache[path] = read(("target", *path.split("/")))
        return cache[path]

    planned = []
    for entry in tensor_names.entries(fam, model):
        key = ("target", *entry.path.split("/"))
        if key not in meta:
            raise ConfigError(f"{step_dir}: has no parameter {entry.path} (the model needs it)")
        if tuple(meta[key].shape) != shapes[entry.path]:
            raise ConfigError(f"{step_dir}: parameter {entry.path} has shape "
                              f"{list(meta[key].shape)}, the model needs "
                              f"{list(shapes[entry.path])}")
        out_dtype = np.dtype(dtype) if dtype else np.dtype(meta[key].dtype)
        planned += _slices(entry, shapes[entry.path], out_dtype, leaf)
    return planned


class LeafReader:
    """One array of a checkpoint at a time, read by tensorstore with the spec Orbax gives it
    (as Orbax's own restore reads it, without a restore's set-up for each array)."""

    def __init__(self, meta: Mapping[tuple[str, ...], Any]):
        self.meta = meta
        self.context = ocp.type_handlers.get_ts_context(use_ocdbt=True)

    def __call__(self, key: tuple[str, ...]) -> np.ndarray:
        info = ocp.type_handlers.ParamInfo(
            name=self.meta[key].name, parent_dir=epath.Path(self.meta[key].directory),
            is_ocdbt_checkpoint=ocp.type_handlers.is_ocdbt_checkpoint(
                epath.Path(self.meta[key].directory)))
        spec = ocp.type_handlers.get_json_tspec_read(info, bool(info.is_ocdbt_checkpoint))
        try:
            store = ts.open(ts.Spec(spec), open=True, read=True, context=self.context).result()
            return store.read().result()
        except (ValueError, RuntimeError) as err:  # tensorstore's for a damaged array
            raise checkpoints.CheckpointError(f"{self.meta[key].directory}: array "
                                              f"{self.meta[key].name} cannot be read "
                                              f"({err})") from err


def _slices(entry: tensor_names.Entry, shape, dtype, leaf) -> list[safetensors_io.Planned]:
    one = entry.hf_shape(shape)
    out = []
    for index, name in zip(np.ndindex(*shape[:entry.depth]), entry.names(), strict=True):
        def make(index=index):
            x = leaf(entry.path)[index]
            return safetensors_io.transposed(x) if entry.transpose else x
        out.append((name, one, dtype, make))
    return out


def export_model(checkpoint: str | Path, out: str | Path, model_entry: str | None = None,
                 config_dir: str | None = None, family: str | None = None,
                 dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Export a checkpoint to out (new or empty); returns a summary."""
    out = Path(out).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out={out}: exists and is not an empty directory")
    step_dir = locate(checkpoint)
    model = (compose_entry(model_entry, config_dir) if model_entry
             else model_of_dir(step_dir.parent))
    if model is None:
        raise ConfigError(f"checkpoint={checkpoint}: no model entry beside it; name it with "
                          "model=<conf/model entry> (and config_dir= for your own entries)")
    if family:
        if family not in families.BY_NAME:
            raise ConfigError(f"family={family}: not one of {', '.join(families.BY_NAME)}")
        fam = families.BY_NAME[family]
        check_family(fam, model)
    else:
        fam = family_for(model)
    with phases.phase("checking the checkpoint against the model"):
        planned = _planned(fam, model, step_dir, dtype)
    staging = out.with_name(f"{out.name}.exporting-{os.getpid()}")
    try:
        return _write(staging, out, fam, model, step_dir, planned, max_shard_bytes)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write(staging: Path, out: Path, fam, model, step_dir, planned, max_shard_bytes) -> dict:
    staging.mkdir(parents=True)
    groups = safetensors_io.shards(planned, max_shard_bytes)
    files = ({safetensors_io.SINGLE: groups[0]} if len(groups) == 1 else
             {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g
              for i, g in enumerate(groups)})
    total = 0
    with phases.phase(f"writing {len(planned)} tensors"):
        for name, group in files.items():
            for _, nbytes in safetensors_io.write_file(staging / name, group):
                total += nbytes
    if len(files) > 1:
        safetensors_io.write_index(staging, files, total)
    extra = _tokenizer_files(model, staging)
    config = families.hf_config(fam, model, extra)
    config["torch_dtype"] = str(planned[0][2]) if planned else "float32"
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return {"out": str(out), "architecture": fam.architecture, "tensors": len(planned),
            "bytes": total, "files": len(files), "checkpoint": str(step_dir)}


def _tokenizer_files(model: Mapping[str, Any], staging: Path) -> dict:
    """Copy the model's tokenizer files (those beside its vocabulary file); the imported
    config.json's token ids, when it was kept there."""
    path = model.get("vocabulary_path")
    if not path or not Path(path).is_file():
        return {}
    folder = Path(path).parent
    for f in TOKENIZER_FILES:
        if f != "config.json" and (folder / f).is_file():
            shutil.copyfile(folder / f, staging / f)
    source = folder / "config.json"
    return json.loads(source.read_text()) if source.is_file() else {}
