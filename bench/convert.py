"""capibara-exp-convert against a plain read of the same safetensors, in one run.

Builds a Llama-shaped model directory of about --gb gigabytes (random bfloat16 weights,
written here with the converter's own safetensors writer; a tokenizer-less directory as
transformers saves one), then times and measures, each in a fresh process:

- a plain read: every tensor of the files read into memory once (the converter's reader,
  one read per tensor, no conversion);
- the floors under an import, each from memory (the checkpoint's arrays made beforehand, not
  timed): a raw write of the same bytes, a file per array, on the same filesystem, without
  and with an fsync per file (tensorstore's file store syncs each file it writes); every
  kernel transposed in memory (PyTorch's [out, in] to the networks' [in, out]); tensorstore
  writing the arrays with the spec Orbax gives each, all at once; Orbax's own save of the
  same tree; the kernels read back by tensorstore (into row-major arrays, as a restore
  does) when stored row-major and when stored column-major (zarr's order F, which would
  spare the import its transposes), from memory;
- the import: the same files into a T5X-layout checkpoint;
- the export: that checkpoint back into safetensors.

Prints throughput (bytes of weights per second), each one's ratio to the plain read (the
goal is >= 0.7x) and the CPU seconds it used (user and system, all threads: next to the
wall time, whether a step waited for the cores or for the disk), the import's time against
the floors and where it goes, and the import's peak host memory (RSS above the process's
start) against the largest tensor and against the model, also less what an import of a
model 1/64 the size takes (the goal: bounded by a few tensors, flat in model size).

    python bench/convert.py [--gb 2.0] [--layers 8] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = r"""
import json, os, sys, threading, time, psutil
peak = [0]
proc = psutil.Process()
start = proc.memory_info().rss
def watch():
    while True:
        peak[0] = max(peak[0], proc.memory_info().rss); time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
what, src, out = sys.argv[1:4]
from pathlib import Path
import numpy as np
from capibara_exp.convert import hf_export, hf_import, safetensors_io  # (start-up not timed)

def model():
    config = json.loads((Path(src) / "config.json").read_text())
    fam, keys = hf_import.families.model_keys(config)
    keys.update(scan_layers=False, dtype="bfloat16")
    return fam, keys, hf_import.param_shapes(keys), safetensors_io.Checkpoint(Path(src))

def made():  # the checkpoint's arrays, made beforehand (not timed)
    fam, keys, shapes, ckpt = model()
    return {e.path: hf_import.lazy_leaf(ckpt, e, shapes[e.path]).load()
            for e in hf_import.names.entries(fam, keys)}

if what in ("raw_write", "raw_write_fsync", "ts_write", "orbax_write", "transpose",
            "restore_C", "restore_F"):
    arrays = made() if what != "transpose" else None
    if what == "transpose":
        fam, keys, shapes, ckpt = model()
        kernels = [ckpt.tensor(e.names()[0]) for e in hf_import.names.entries(fam, keys)
                   if e.transpose and isinstance(e.sources, str)]
if what.startswith("restore_"):  # the kernels stored row- or column-major (in memory)
    import tensorstore as ts
    stores = []
    for a in (a for a in arrays.values() if a.ndim == 2):
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "memory"}, "metadata": {
            "shape": list(a.shape), "chunks": list(a.shape), "dtype": "bfloat16",
            "compressor": None, "order": what[-1]}}, create=True).result()
        store.write(a).result()
        stores.append(store)
    del arrays
start = proc.memory_info().rss
t0, cpu0 = time.perf_counter(), sum(proc.cpu_times()[:2])
if what.startswith("restore_"):  # read back as a restore does: into row-major arrays
    for store in stores:
        store.read().result()
elif what == "read":
    ckpt = safetensors_io.Checkpoint(Path(src))
    total = 0
    for name in ckpt.names():
        total += ckpt.tensor(name).nbytes  # each tensor read into memory once
elif what.startswith("raw_write"):  # the same bytes, a file each, on the same filesystem
    os.makedirs(out)
    for i, a in enumerate(arrays.values()):
        with open(f"{out}/{i}", "wb") as f:
            f.write(a.reshape(-1).view(np.uint8).data)
            if what.endswith("fsync"):
                f.flush(); os.fsync(f.fileno())
elif what == "transpose":  # every kernel transposed in memory, as the import does
    for k in kernels:
        safetensors_io.transposed(k)
elif what == "ts_write":  # tensorstore alone: Orbax's spec for each array, all at once
    import asyncio, tensorstore as ts
    import orbax.checkpoint as ocp
    from etils import epath
    os.makedirs(out)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    async def write(name, a):
        info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(out),
                                           is_ocdbt_checkpoint=True, use_compression=False)
        spec = ocp.type_handlers.get_json_tspec_write(info, True, a.shape, a.shape, a.dtype, 0)
        store = await ts.open(ts.Spec(spec), create=True, open=True, context=context)
        await store.write(a, can_reference_source_data_indefinitely=True)
    async def main():
        await asyncio.gather(*(write(n.replace("/", "."), a) for n, a in arrays.items()))
    asyncio.run(main())
elif what == "orbax_write":  # Orbax's own save of the same arrays from memory
    import orbax.checkpoint as ocp
    from flax import traverse_util
    tree = {"state": {"step": np.asarray(0, np.int32)},
            "target": traverse_util.unflatten_dict(arrays, sep="/")}
    start, t0, cpu0 = proc.memory_info().rss, time.perf_counter(), sum(proc.cpu_times()[:2])
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True,
                                                      use_compression=False)) as c:
        c.save(out, args=ocp.args.PyTreeSave(tree))
elif what == "import":  # where its time goes: the checks, the arrays, the manifest, the rest
    marks = {}
    def timed(module, name):
        inner = getattr(module, name)
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                marks[name] = (begin - t0, time.perf_counter() - begin)
        setattr(module, name, wrapper)
    if hasattr(hf_import, "t5x_writer"):
        timed(hf_import.t5x_writer, "save")
        timed(hf_import.t5x_writer.integrity, "write_manifest")
    hf_import.import_model(src, out, name="bench")
else:
    hf_export.export_model(src, out)
seconds, cpu = time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0
time.sleep(0.02)
print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_rss_above_start": peak[0] - start,
                  "marks": marks if what == "import" else {}}))
"""


def build(directory: Path, gb: float, layers: int) -> dict:
    """A Llama-shaped model of about `gb` GB of bfloat16 weights; its sizes."""
    import ml_dtypes

    from capibara_exp.convert import safetensors_io

    d = int(((gb * 2**30 / 2) / (layers * 12 + 2 * 8)) ** 0.5) // 256 * 256  # ~12 d^2 a layer
    heads, f, vocab = d // 64, 3 * d, 8 * d
    kv = heads // 4
    shapes = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d),
              "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * 64, d),
                       p + "self_attn.k_proj.weight": (kv * 64, d),
                       p + "self_attn.v_proj.weight": (kv * 64, d),
                       p + "self_attn.o_proj.weight": (d, heads * 64),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f),
                       p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    planned = [(n, s, bf16, lambda s=s: (rng.standard_normal(s, np.float32) * 0.02).astype(bf16))
               for n, s in shapes.items()]
    groups = safetensors_io.shards(planned, 2**30)
    files = {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g
             for i, g in enumerate(groups)}
    total = 0
    for name, group in files.items():
        for _, nbytes in safetensors_io.write_file(directory / name, group):
            total += nbytes
    safetensors_io.write_index(directory, files, total)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": 64, "vocab_size": vocab,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
              "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    largest = max(int(np.prod(s)) * 2 for s in shapes.values())
    return {"bytes": total, "largest_tensor": largest, "emb_dim": d, "layers": layers}


def drop_caches() -> bool:
    """Empty the page cache (root on Linux), so each step reads from the disk."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure(what: str, src: Path, out: Path, cold: bool) -> dict:
    if cold and not drop_caches():
        raise SystemExit("--cold needs to write /proc/sys/vm/drop_caches (root on Linux)")
    os.sync()  # the steps before's dirty pages on disk: no step is throttled for another's
    result = subprocess.run([sys.executable, "-c", CHILD, what, str(src), str(out)],
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{what} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cold", action="store_true",
                        help="empty the page cache before each step (the files come from disk)")
    args = parser.parse_args()
    steps = ("read", "raw_write", "raw_write_fsync", "transpose", "ts_write", "orbax_write",
             "import", "export", "restore_C", "restore_F")
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp).absolute()
        (root / "hf").mkdir()
        (root / "tiny").mkdir()
        sizes = build(root / "hf", args.gb, args.layers)
        build(root / "tiny", args.gb / 64, args.layers)
        results = {}
        for what in steps:
            src = root / ("imported" if what == "export" else "hf")
            cold = args.cold and what in ("read", "import", "export")
            results[what] = measure(what, src, root / what.replace("import", "imported"), cold)
        tiny = measure("import", root / "tiny", root / "tiny_imported", False)
    gb = sizes["bytes"] / 1e9
    load = os.getloadavg()
    print(f"{'cold (page cache emptied before each)' if args.cold else 'warm page cache'}; "
          f"model: {gb:.2f} GB bfloat16, emb_dim {sizes['emb_dim']}, {sizes['layers']} layers, "
          f"largest tensor {sizes['largest_tensor'] / 1e6:.0f} MB; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    read = results["read"]["seconds"]
    for name, r in results.items():
        rate = gb / r["seconds"]
        print(f"{name:16s} {r['seconds']:7.2f} s  {rate:6.3f} GB/s  "
              f"{read / r['seconds']:5.2f} x the plain read  cpu {r['cpu']:6.2f} s  "
              f"peak RSS +{r['peak_rss_above_start'] / 1e6:7.0f} MB")
    imported, floor = results["import"], results["orbax_write"]["seconds"]
    print(f"import: {imported['seconds'] / floor:.2f} x the time Orbax takes to write "
          "the same parameters from memory (the write alone, parameters made beforehand); "
          f"{imported['seconds'] / results['ts_write']['seconds']:.2f} x tensorstore's; "
          f"{imported['seconds'] / results['raw_write_fsync']['seconds']:.2f} x a raw write "
          "of the same bytes with fsync")
    print(f"export: {results['export']['seconds'] / results['raw_write']['seconds']:.2f} x a "
          "raw write of the same bytes (the export does not fsync)")
    column = results["restore_F"]["seconds"] / results["restore_C"]["seconds"]
    print("kernels stored column-major (zarr order F: no transposes at import) read back into "
          f"row-major arrays: {column:.1f} x the time of the same kernels stored row-major "
          "(the cost every restore would pay)")
    marks = imported.get("marks") or {}
    if marks:
        (start, save), (_, manifest) = marks["save"], marks["write_manifest"]
        print(f"import's time: {start:.2f} s checking (the network traced for its shapes, the "
              f"headers), {save - manifest:.2f} s writing the arrays (Orbax's save), "
              f"{manifest:.2f} s the checksum manifest (every file read back), "
              f"{imported['seconds'] - start - save:.2f} s the rest")
    peak, fixed = imported["peak_rss_above_start"], tiny["peak_rss_above_start"]
    print(f"import peak host memory: {peak / sizes['largest_tensor']:.2f} x the largest tensor, "
          f"{peak / sizes['bytes']:.2f} x the model; less the {fixed / 1e6:.0f} MB an import "
          f"of a 1/64 model takes ({tiny['seconds']:.2f} s: threads, libraries' pages): "
          f"{(peak - fixed) / sizes['largest_tensor']:.2f} x the largest tensor")

if __name__ == "__main__":
    main()
