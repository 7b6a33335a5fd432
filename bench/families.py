"""Step time of a Llama-style model against the project's T5-style decoder at equal parameter
count, in one process (the same bare jitted train step as bench/step_time.py, the same batch).

The T5-style decoder is dense_tiny at the given width (relative position bias, MHA, gated
GELU); the Llama-style model is llama3_tiny at the same width and depth (rope with Llama 3.1
scaling, GQA with half the key/value heads, SwiGLU, scaled scores), its MLP widened until
model_facts counts the same parameters (GQA's saving goes to the MLP). Prints both step
times, their ratio and each one's share of this CPU's measured matmul peak.

    python bench/families.py [--steps 30] [--width 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from omegaconf import OmegaConf
from step_time import bare_loop, compose, prepared_gin


def model_and_batch(overrides: list[str], model_dir: Path):
    import gin

    from capibara_exp.runtime import gin_utils, inputs

    cfg = compose(["trainer.eval_steps=0", *overrides], model_dir)
    path = prepared_gin(cfg, model_dir)
    gin_utils.parse(path)
    model = gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    train_cfg = gin.query_parameter("train_script.train.train_dataset_cfg").scoped_configurable_fn()
    batch = next(inputs.batches(train_cfg, model.FEATURE_CONVERTER_CLS, seed=0))
    return cfg, model, batch


def matching_mlp(t5_keys: dict, llama_keys: dict) -> int:
    """The Llama-style MLP width (a multiple of 8) whose parameter count is nearest the T5's."""
    from capibara_exp.base import model_facts

    want = model_facts.counts(model_facts.sizes(t5_keys)).total

    def total(mlp: int) -> int:
        return model_facts.counts(model_facts.sizes({**llama_keys, "mlp_dim": mlp})).total

    return min(range(8, 8 * t5_keys["mlp_dim"], 8), key=lambda m: abs(total(m) - want))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    from capibara_exp.base import model_facts
    from capibara_exp.runtime.metrics import matmul_peak_flops

    heads = args.width // 64
    common = [f"model.emb_dim={args.width}", f"model.num_heads={heads}", "model.head_dim=64",
              f"model.num_layers={args.layers}", "data.batch_size=8"]
    t5 = ["model=dense_tiny", *common, f"model.mlp_dim={4 * args.width}"]
    llama = ["model=llama3_tiny", *common, f"model.num_kv_heads={max(1, heads // 2)}",
             "model.query_pre_attn_scalar=64.0"]
    peak = matmul_peak_flops()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        t5_cfg, _, _ = model_and_batch(t5, Path(tmp) / "t5")
        l_cfg, _, _ = model_and_batch(llama, Path(tmp) / "probe")
        t5_keys = OmegaConf.to_container(t5_cfg.model, resolve=True)
        l_keys = OmegaConf.to_container(l_cfg.model, resolve=True)
        llama.append(f"model.mlp_dim={matching_mlp(t5_keys, l_keys)}")
        styles = (("T5-style (dense_tiny)", t5), ("Llama-style (llama3_tiny)", llama))
        for name, overrides in styles:
            cfg, model, batch = model_and_batch(overrides, Path(tmp) / name[:5])
            keys = OmegaConf.to_container(cfg.model, resolve=True)
            seconds, flops = bare_loop(model, batch, args.steps)
            params = model_facts.counts(model_facts.sizes(keys)).total
            results[name] = seconds
            print(f"{name:26s} {params / 1e6:6.2f}M params  mlp {keys['mlp_dim']:5d}  "
                  f"{seconds * 1e3:8.2f} ms/step  {flops / seconds / peak:5.1%} of peak")
    t5_s, llama_s = results.values()
    print(f"Llama-style / T5-style step time: {llama_s / t5_s:.3f} "
          f"(batch {batch['decoder_target_tokens'].shape}, peak {peak / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
