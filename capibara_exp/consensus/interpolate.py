"""Interpolating merges as pure functions of one leaf: SLERP between two models (with
per-layer factors) and Model Stock's interpolation toward the base.

- SLERP (Shoemake 1985, as model mergers use it): the leaf of each model seen as one
  vector; the result lies on the arc between them at angle t x theta (t = 0: the first
  model), with lengths kept by the same weights; nearly parallel leaves (|cos| > 0.9995)
  are interpolated linearly. `t` is a number or, as mergekit's gradients, a list of
  anchors spread evenly over the layers and interpolated linearly in between.
- Model Stock (Jang et al. 2024): per leaf, with theta the mean pairwise angle between the
  candidates' offsets from the base w_0, t = N cos(theta) / (1 + (N - 1) cos(theta)) and
  the result t x mean(w_i) + (1 - t) x w_0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

DOT_THRESHOLD = 0.9995  # above this |cos|, SLERP interpolates linearly (as mergekit)
_LAYER_RE = re.compile(r"^layers_(\d+)$")


def slerp(t: float | np.ndarray, a: np.ndarray, b: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Spherical interpolation between two leaves; `t` a number or one per leading-axis
    slice of a scanned leaf (its layers), each slice then a vector of its own."""
    t_arr = np.asarray(t, np.float64)
    if t_arr.ndim:
        return np.stack([slerp(float(ti), a[i], b[i], eps) for i, ti in enumerate(t_arr)])
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    dot = float(np.sum((a64 / na if na > eps else a64) * (b64 / nb if nb > eps else b64)))
    if abs(dot) > DOT_THRESHOLD:
        out = (1.0 - t) * a64 + t * b64
    else:
        theta = np.arccos(np.clip(dot, -1.0, 1.0))
        out = (np.sin((1.0 - t) * theta) * a64 + np.sin(t * theta) * b64) / np.sin(theta)
    return out.astype(np.asarray(a).dtype)


def gradient_value(anchors: Sequence[float], position: float) -> float:
    """The value at `position` in [0, 1] of anchors spread evenly over [0, 1]."""
    if len(anchors) == 1:
        return float(anchors[0])
    return float(np.interp(position * (len(anchors) - 1), np.arange(len(anchors)), anchors))


def layer_positions(paths: Sequence[tuple[str, ...]], shapes: dict) -> dict:
    """{path: its layers' positions in [0, 1]}: a float for a leaf of layer i
    (…/layers_i/…), an array over the leading axis of a scanned leaf
    (…/layers/layers_j/… with R repeats of B layers: layer r x B + j), 0.0 for leaves
    before the layers (the embedder) and 1.0 for those after (final norm, logits)."""
    found = {}
    for p in paths:
        names = list(p)
        for k, name in enumerate(names):
            m = _LAYER_RE.match(name)
            if m:
                found[p] = (k > 0 and names[k - 1] == "layers", int(m.group(1)))
                break
    block = 1 + max((j for scanned, j in found.values() if scanned), default=-1)
    repeats = max((shapes[p][0] for p in found if found[p][0]), default=1)
    num = max([j + 1 for scanned, j in found.values() if not scanned] + [block * repeats, 1])
    out = {}
    for p in paths:
        if p not in found:
            out[p] = 0.0 if any("embed" in name for name in p) else 1.0
            continue
        scanned, j = found[p]
        layers = np.arange(shapes[p][0]) * block + j if scanned else np.float64(j)
        out[p] = layers / max(num - 1, 1)
    return out


def slerp_factor(t: float | Sequence[float], position: float | np.ndarray) -> float | np.ndarray:
    """`t` at a leaf's layer position(s): the number itself, or the gradient's value."""
    if isinstance(t, (int, float)):
        return float(t) if np.ndim(position) == 0 else np.full(np.shape(position), float(t))
    if np.ndim(position) == 0:
        return gradient_value(t, float(position))
    return np.array([gradient_value(t, float(x)) for x in position])


def model_stock(leaves: Sequence[np.ndarray], base: np.ndarray) -> np.ndarray:
    """Model Stock's merge of one leaf of N >= 2 candidates around the base."""
    w0 = np.asarray(base, np.float64).reshape(-1)
    offsets = [np.asarray(x, np.float64).reshape(-1) - w0 for x in leaves]
    cosines = []
    for i in range(len(offsets)):
        for j in range(i + 1, len(offsets)):
            norms = np.linalg.norm(offsets[i]) * np.linalg.norm(offsets[j])
            cosines.append(np.clip(offsets[i] @ offsets[j] / max(norms, 1e-6), -1.0, 1.0))
    cos = float(np.mean(cosines))
    n = len(leaves)
    t = n * cos / (1.0 + (n - 1) * cos)
    mean = np.mean([np.asarray(x, np.float64) for x in leaves], axis=0).reshape(-1)
    return (t * mean + (1.0 - t) * w0).reshape(np.shape(base)).astype(np.asarray(base).dtype)
