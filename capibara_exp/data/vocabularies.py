"""The model's vocabulary, named by the `model` group (`vocabulary`, `vocabulary_path`) and
used by the model and every data task alike.

- byte: seqio's ByteVocabulary (the project's default).
- sentencepiece: seqio's SentencePieceVocabulary over a `.model` file (a published model's
  tokenizer.model, or one trained by `capibara-exp-convert sentencepiece`).
- tokenizer_json: a Hugging Face `tokenizer.json`, run by the `tokenizers` library and
  wrapped as a seqio Vocabulary (TokenizerJsonVocabulary). Its special tokens come from the
  `tokenizer_config.json` beside it (eos_token, bos_token, unk_token) or, failing that, the
  model's `config.json` (eos_token_id, bos_token_id).

seqio and T5X pad with id 0 and weigh the loss by `targets > 0`: a tokenizer whose id 0 is
an ordinary token (Llama 3's and Qwen's "!") has that token treated as padding.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import seqio
import tensorflow as tf

from capibara_exp.base import model_facts
from capibara_exp.base.errors import ConfigError

_WHERE = "model.vocabulary"


class TokenizerJsonVocabulary(seqio.Vocabulary):
    """A Hugging Face tokenizer.json as a seqio Vocabulary (no special tokens added: seqio
    appends EOS itself; encoding runs on the host inside tf.data)."""

    def __init__(self, path: str | Path, extra_ids: int = 0):
        from tokenizers import Tokenizer

        self._path = Path(path)
        self._tokenizer = Tokenizer.from_file(str(self._path))
        self._digest = hashlib.sha256(self._path.read_bytes()).hexdigest()
        self._special = _special_ids(self._path, self._tokenizer)
        super().__init__(extra_ids=extra_ids)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def digest(self) -> str:
        """SHA-256 of the tokenizer.json: what makes two of these the same vocabulary."""
        return self._digest

    @property
    def eos_id(self) -> int | None:
        return self._special.get("eos")

    @property
    def bos_id(self) -> int | None:
        return self._special.get("bos")

    @property
    def unk_id(self) -> int | None:
        return self._special.get("unk")

    @property
    def _base_vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _encode(self, s: str) -> Sequence[int]:
        return self._tokenizer.encode(s, add_special_tokens=False).ids

    def _decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        def encode(text) -> np.ndarray:  # a bytes scalar, as a 0-d object array or bytes
            text = text.item() if isinstance(text, np.ndarray) else text
            return np.asarray(self._encode(text.decode("utf-8")), np.int32)

        ids = tf.numpy_function(encode, [s], tf.int32, stateful=False)
        return tf.ensure_shape(ids, [None])

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        def decode(row: np.ndarray) -> bytes:
            return self._decode([i for i in row.tolist() if i != self.pad_id]).encode("utf-8")

        if ids.shape.rank != 1:
            return tf.map_fn(self._decode_tf, ids, fn_output_signature=tf.string)
        return tf.ensure_shape(tf.numpy_function(decode, [ids], tf.string, stateful=False), [])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TokenizerJsonVocabulary) and self.digest == other.digest
                and self.extra_ids == other.extra_ids)

    def __hash__(self) -> int:
        return hash(self._digest)


def _special_ids(path: Path, tokenizer) -> dict[str, int]:
    """eos/bos/unk ids from tokenizer_config.json (token strings) or config.json (ids)."""
    out: dict[str, int] = {}
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        for key in ("eos", "bos", "unk"):
            token = json.loads(config.read_text()).get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            found = tokenizer.token_to_id(token) if isinstance(token, str) else None
            if found is not None:
                out[key] = found
    model_config = path.parent / "config.json"
    if model_config.is_file():
        ids = json.loads(model_config.read_text())
        for key in ("eos", "bos"):
            value = ids.get(f"{key}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if key not in out and isinstance(value, int):
                out[key] = value
    return out


@functools.lru_cache(maxsize=16)
def get(kind: str = "byte", path: str | None = None) -> seqio.Vocabulary:
    """The vocabulary a model entry names; the same object for the same (kind, path), so the
    model's and the tasks' vocabularies compare equal (T5X checks that they do)."""
    if kind not in model_facts.VOCABULARIES:
        raise ConfigError(f"{_WHERE}={kind!r} is not one of {', '.join(model_facts.VOCABULARIES)}")
    if kind == "byte":
        return seqio.ByteVocabulary()
    if not path or not Path(path).is_file():
        raise ConfigError(f"model.vocabulary_path={path!r}: model.vocabulary={kind} needs the "
                          "tokenizer's file (a .model for sentencepiece, a tokenizer.json)")
    if kind == "sentencepiece":
        return seqio.SentencePieceVocabulary(str(Path(path).absolute()))
    return TokenizerJsonVocabulary(Path(path).absolute())


def tag(vocabulary: seqio.Vocabulary) -> str:
    """A short name of a vocabulary for task names ('' for the byte vocabulary)."""
    if isinstance(vocabulary, seqio.ByteVocabulary):
        return ""
    if isinstance(vocabulary, TokenizerJsonVocabulary):
        source = vocabulary.path.read_bytes()
    else:
        source = vocabulary.sp_model
    return hashlib.sha256(source).hexdigest()[:10]


def check_fits(vocabulary: seqio.Vocabulary, vocab_size: int) -> None:
    """The model's embedding must have a row for every id the vocabulary produces."""
    if vocabulary.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the vocabulary's "
                          f"{vocabulary.vocab_size} ids ({_WHERE})")
