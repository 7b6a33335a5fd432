"""A SentencePiece vocabulary trained on the project's own corpus (`capibara-exp-convert
sentencepiece`), so the default experiment can train on subwords instead of bytes.

The ids follow seqio's convention: 0 pad, 1 EOS, 2 UNK, no BOS; byte fallback, so every
string encodes (unseen characters as their UTF-8 bytes), and no normalization (identity
rule, whitespace kept), so every string decodes back as it was. The report measures tokens per
byte of the corpus' validation split against the byte vocabulary's one per byte.
"""

from __future__ import annotations

import os
from pathlib import Path

from capibara_exp.base.errors import ConfigError
from capibara_exp.data import corpus

MODEL_TYPES = ("unigram", "bpe")


def check_settings(out: str | os.PathLike, vocab_size: int, model_type: str) -> Path:
    """The output file and the settings, refused in one line before any work (and before
    the console script's heavy imports); the absolute output path."""
    out = Path(out).expanduser().absolute()
    if out.suffix != ".model":
        raise ConfigError(f"out={out}: a SentencePiece model file ends in .model")
    if out.exists():
        raise ConfigError(f"out={out}: exists already; give a new file name")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type={model_type}: not one of {', '.join(MODEL_TYPES)}")
    if vocab_size < 300:  # 256 byte pieces + specials + some subwords
        raise ConfigError(f"vocab_size={vocab_size}: must be >= 300 (the 256 byte-fallback "
                          "pieces come first)")
    return out


def train(out: str | os.PathLike, data_dir: str | os.PathLike, vocab_size: int = 8000,
          model_type: str = "unigram") -> dict:
    """Train on the corpus' train split; write OUT (a .model); report tokens per byte."""
    import sentencepiece as spm

    out = check_settings(out, vocab_size, model_type)
    corpus.build_corpus(data_dir)  # what it trains on, built here first (as a run builds it)
    text = corpus.corpus_dir(data_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.stem}.training-{os.getpid()}")
    try:
        spm.SentencePieceTrainer.train(
            input=str(text / "train.txt"), model_prefix=str(staging), vocab_size=vocab_size,
            model_type=model_type, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
            byte_fallback=True, character_coverage=1.0, input_sentence_size=2_000_000,
            # text as it is (code: indentation, newlines, no NFKC folding), so that decoding
            # gives back what was encoded
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            shuffle_input_sentence=True, minloglevel=2, num_threads=os.cpu_count() or 1)
        os.replace(f"{staging}.model", out)
    finally:
        for suffix in (".model", ".vocab"):
            Path(f"{staging}{suffix}").unlink(missing_ok=True)
    return {"model": str(out), "vocab_size": vocab_size, "model_type": model_type,
            **tokens_per_byte(out, text / "validation.txt")}


def tokens_per_byte(model: Path, text_file: Path) -> dict:
    """Tokens per UTF-8 byte of a text file's lines (each line + EOS, as the LM task
    tokenizes), for the model and for the byte vocabulary."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    lines = text_file.read_text(encoding="utf-8").splitlines()
    nbytes = sum(len(line.encode("utf-8")) for line in lines)
    pieces = sum(len(ids) + 1 for ids in sp.encode(lines))
    bytes_tokens = nbytes + len(lines)
    return {"validation_bytes": nbytes, "tokens_per_byte": pieces / max(nbytes, 1),
            "byte_vocabulary_tokens_per_byte": bytes_tokens / max(nbytes, 1),
            "sequence_length_gain": bytes_tokens / max(pieces, 1)}
