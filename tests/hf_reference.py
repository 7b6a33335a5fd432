"""Tiny reference models and tokenizers built on the machine with transformers and tokenizers
(`from_config`, `save_pretrained`: nothing downloaded), for the parity tests.

Weights are drawn again after construction (normal, scaled by fan-in; norm scales around
their identity value) so that every part of each family changes the logits: biases,
QK-norms, Gemma's +1 norms and soft-caps (set low enough to bite) included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# family -> (transformers config class name, its options beyond SIZES)
FAMILIES = {
    "llama2": ("LlamaConfig", dict(rope_theta=10_000.0)),  # Llama 2: plain RoPE, no scaling
    "llama3": ("LlamaConfig", dict(rope_theta=500_000.0, rope_scaling=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "qwen2_5": ("Qwen2Config", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict()),
    "gemma2": ("Gemma2Config", dict(sliding_window=5, query_pre_attn_scalar=16,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=5, sliding_window_pattern=3,
                                        num_hidden_layers=5, query_pre_attn_scalar=12,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=True)),
}
TEXT = ["def add(a, b):\n    return a + b\n", "SELECT name, total FROM orders WHERE id = 7;",
        "Grüße aus München, ça va? Año nuevo.", "这是一个测试。日本語のテキスト。",
        "console.log(`x=${x}`); // ok", "Привет, мир! 1234.5 + 6e-7"]


def build_model(family: str, directory: Path, seed: int = 0, dtype: str = "float32",
                **overrides) -> Path:
    """save_pretrained of a tiny random model of the family into `directory`."""
    import torch
    import transformers

    name, options = FAMILIES[family]
    config = getattr(transformers, name)(**{**SIZES, **options, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.3)
            elif p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.5 / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    return directory


def reference_logits(directory: Path, tokens: np.ndarray) -> tuple[np.ndarray, list]:
    """Logits [B, L, V] and hidden states after each layer, from transformers' forward."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval().float()
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states[1:]]


def build_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer (tokenizer.json and tokenizer_config.json) trained on a
    small multilingual and code sample, saved as transformers saves tokenizers."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<pad>", "</s>", "<unk>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>",
                                                bos_token="<s>")
    fast.save_pretrained(directory)
    config = directory / "config.json"
    if config.is_file():  # the model's token ids follow the tokenizer's
        values = json.loads(config.read_text())
        values.update(eos_token_id=1, bos_token_id=3, pad_token_id=0)
        config.write_text(json.dumps(values, indent=2))
    return directory
