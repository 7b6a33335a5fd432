"""Packing with the Cython kernel into seqio's decoder features, and the packer setting.

`packer` is the setting (gin: `data_packing.packer.strategy`, from conf/data/ `packing`), which
the input pipeline takes as an argument (runtime/inputs.py: the DatasetConfig's `packer`):
'first_fit' (the kernel's best fill; the local engine's default), 'next_fit' (the kernel
reproducing seqio's rows bit for bit) or 'seqio' (seqio's own feature converter).
`decoder_features` turns packed rows into the features seqio.DecoderFeatureConverter
gives a packed LM task, so the model sees the same batch format either way.

A model may ask for one integer label per example to travel with its tokens (router
supervision from the routing tasks' `domain_id`): its feature converter class then names
the task feature (`carrying_labels`), and `Packer.pack_labels` places the labels exactly
where `Packer.pack` placed the tokens, as the batch feature `decoder_<feature>`, -1 on
padding.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from capibara_exp.kernels import packing as kernel

STRATEGIES = ("first_fit", "next_fit", "seqio")
LABEL_PREFIX = "decoder_"
NO_LABEL = -1


@dataclasses.dataclass(frozen=True)
class Packer:
    strategy: str = "first_fit"
    max_open_rows: int = 64

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"data_packing.packer.strategy: '{self.strategy}' is not one of {STRATEGIES}"
            )

    def pack(
        self, tokens: np.ndarray, lengths: np.ndarray, length: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(targets, segment_ids, positions) [rows, length] of examples given flat + lengths."""
        if self.strategy == "first_fit":
            return kernel.pack_first_fit(tokens, lengths, length, self.max_open_rows)
        return kernel.pack_next_fit(tokens, lengths, length, length)  # seqio's chunk: `length`

    def pack_labels(self, tokens: np.ndarray, lengths: np.ndarray, labels: np.ndarray,
                    length: int) -> np.ndarray:
        """[rows, length] int32: each example's label wherever `pack` gives its tokens a
        segment id, NO_LABEL where the segment id is 0 (padding; next-fit's 0 tokens).

        First-fit places examples by their lengths alone and next-fit by which of their
        tokens are non-zero, so packing label + 1 in place of every token (of every
        non-zero token for next-fit) through the same kernel lands each label on its
        example's slots."""
        labels, lengths = np.asarray(labels), np.asarray(lengths)
        if labels.shape != lengths.shape or labels.dtype.kind not in "iu":
            raise ValueError(f"labels must be one integer per example, got {labels.dtype} "
                             f"{labels.shape} for {lengths.shape} examples")
        if labels.size and labels.min() < 0:
            raise ValueError(f"labels must be >= 0 (got {int(labels.min())}): {NO_LABEL} "
                             "marks padding")
        per_token = np.repeat(labels.astype(np.int32) + 1, lengths)
        if self.strategy == "next_fit":
            per_token *= tokens != 0
        return self.pack(per_token, lengths, length)[0] + NO_LABEL


def packer(strategy: str = "first_fit", max_open_rows: int = 64) -> Packer:
    """The packer setting (gin: data_packing.packer; the local engine's gin edge passes
    it to the input pipeline in its DatasetConfigs)."""
    return Packer(strategy, max_open_rows)


def label_feature_of(converter_cls: type) -> str | None:
    """The per-example task feature a feature converter class asks packing to carry."""
    return getattr(converter_cls, "LABEL_FEATURE", None)


def label_batch_feature(feature: str) -> str:
    """The per-token batch feature that carries the task feature `feature`."""
    return LABEL_PREFIX + feature


def carrying_labels(converter_cls: type, feature: str) -> type:
    """`converter_cls` marked to carry the integer task feature `feature` per token, as the
    batch feature `decoder_<feature>`. The local engine's kernel packers carry it; seqio's
    own converters cannot, and the input pipeline says so rather than dropping it."""
    if not feature or not isinstance(feature, str):
        raise ValueError(f"label feature must be a task feature name, got {feature!r}")
    return type(f"{converter_cls.__name__}With_{feature}", (converter_cls,),
                {"LABEL_FEATURE": feature, "__module__": __name__})


def decoder_features(
    targets_RxL: np.ndarray, segment_ids_RxL: np.ndarray, positions_RxL: np.ndarray
) -> dict[str, np.ndarray]:
    """seqio.DecoderFeatureConverter's packed LM features (bos 0) of packed rows."""
    shifted_RxL = np.zeros_like(targets_RxL)
    shifted_RxL[:, 1:] = targets_RxL[:, :-1]
    prev_segment_RxL = np.zeros_like(segment_ids_RxL)
    prev_segment_RxL[:, 1:] = segment_ids_RxL[:, :-1]
    # The first token of every example sees BOS (0), not the previous example's EOS.
    inputs_RxL = np.where(segment_ids_RxL == prev_segment_RxL, shifted_RxL, 0).astype(np.int32)
    return {
        "decoder_target_tokens": targets_RxL,
        "decoder_input_tokens": inputs_RxL,
        "decoder_loss_weights": (targets_RxL != 0).astype(np.int32),
        "decoder_segment_ids": segment_ids_RxL,
        "decoder_positions": positions_RxL,
    }
