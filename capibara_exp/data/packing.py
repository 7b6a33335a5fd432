"""Packing with the Cython kernel into seqio's decoder features, and the packer setting.

`packer` is the setting (gin: `data_packing.packer.strategy`, from conf/data/ `packing`):
'first_fit' (the kernel's best fill; the local engine's default), 'next_fit' (the kernel
reproducing seqio's rows bit for bit) or 'seqio' (seqio's own feature converter).
`decoder_features` turns packed rows into the features seqio.DecoderFeatureConverter
gives a packed LM task, so the model sees the same batch format either way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from capibara_exp.kernels import packing as kernel

STRATEGIES = ("first_fit", "next_fit", "seqio")


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


def packer(strategy: str = "first_fit", max_open_rows: int = 64) -> Packer:
    """The packer setting (a gin configurable of the local engine's input pipeline)."""
    return Packer(strategy, max_open_rows)


def configured_packer() -> Packer:
    """The packer bound in the parsed gin config, or the default when none binds it."""
    import gin

    try:
        return gin.get_configurable(packer)()
    except ValueError:  # no gin config registered this function: nothing bound
        return packer()


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
