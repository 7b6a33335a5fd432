"""Weight solvers that need the model: greedy soup and learned convex (per-layer) weights.

Both stream the candidates: at most the running soup, one candidate's parameters and
the gradient are in memory, never all candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from capibara_exp.consensus import methods
from capibara_exp.consensus.store import Candidate, LeafInfo, LeafPath, LeafReader, unflatten

TARGET: LeafPath = ("target",)


def _target_paths(index: dict[LeafPath, LeafInfo]) -> list[LeafPath]:
    return [p for p in index if p[:1] == TARGET]


def greedy_soup(candidates: Sequence[Candidate], val_loss: dict[str, float], reader: LeafReader,
                index: dict[LeafPath, LeafInfo], evaluator: Any) -> tuple[np.ndarray, list[dict]]:
    """Wortsman et al.'s greedy soup: best first, add a candidate only if held-out loss drops.

    Returns uniform weights over the soup's members and the decision log.
    """
    order = sorted(range(len(candidates)), key=lambda i: val_loss[candidates[i].name])
    paths = _target_paths(index)
    first = order[0]
    soup = {p: reader.read(candidates[first], p, index[p]).astype(jnp.float32) for p in paths}
    members, best = [first], val_loss[candidates[first].name]
    log = [{"candidate": candidates[first].name, "soup_loss": best, "added": True}]
    for i in order[1:]:
        trial = {p: soup[p] + reader.read(candidates[i], p, index[p]) for p in paths}
        k = len(members) + 1
        loss = evaluator.loss(unflatten({p[1:]: (v / k).astype(index[p].dtype)
                                         for p, v in trial.items()}))
        added = loss < best
        log.append({"candidate": candidates[i].name, "soup_loss": loss, "added": added})
        if added:
            soup, best = trial, loss
            members.append(i)
        del trial
    weights = np.zeros(len(candidates))
    weights[members] = 1.0 / len(members)
    return weights, log


def layer_of(path: LeafPath) -> LeafPath:
    """The layer a parameter belongs to: target/<module>[/<submodule>] (e.g. layers_3)."""
    return path[:3] if len(path) > 3 else path[:2]


def _merged_params(candidates, reader, index, paths, w_NxG, group_of) -> dict:
    out = {}
    for p in paths:
        leaves = [reader.read(c, p, index[p]) for c in candidates]
        out[p[1:]] = methods.weighted_mean(leaves, w_NxG[:, group_of[p]])
    return unflatten(out)


def _grad_dots(candidates, reader, index, paths, grads, group_of, num_groups) -> np.ndarray:
    """dL/dw[i, g] = sum over leaves l in layer g of <dL/dtheta_l, theta_i,l>."""
    flat_grads = {tuple(str(k.key) for k in path): g
                  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    dots = np.zeros((len(candidates), num_groups))
    for p in paths:
        g = np.asarray(flat_grads[p[1:]], np.float64).reshape(-1)
        for i, c in enumerate(candidates):
            dots[i, group_of[p]] += float(g @ np.asarray(reader.read(c, p, index[p]),
                                                         np.float64).reshape(-1))
    return dots


def learned_weights(candidates: Sequence[Candidate], reader: LeafReader,
                    index: dict[LeafPath, LeafInfo], evaluator: Any, steps: int,
                    learning_rate: float, per_layer: bool = True
                    ) -> tuple[np.ndarray, dict[LeafPath, int], list[float]]:
    """Softmax weights per candidate (and per layer) minimising the real validation loss.

    Each step merges with the current weights (one pass), takes the loss gradient with
    respect to the merged parameters, and gets the weight gradient from inner products
    with each candidate (a second pass). Returns the best weights seen [N, G], the layer
    index of each target path, and the loss per step (the first is the uniform merge).
    """
    paths = _target_paths(index)
    layers = sorted({layer_of(p) for p in paths}) if per_layer else [TARGET]
    group_of = {p: layers.index(layer_of(p)) if per_layer else 0 for p in paths}
    logits = jnp.zeros((len(candidates), len(layers)))
    opt = optax.adam(learning_rate)
    opt_state = opt.init(logits)
    best_w, best_loss, history = None, float("inf"), []
    for _ in range(steps + 1):
        w = np.asarray(jax.nn.softmax(logits, axis=0), np.float64)
        params = _merged_params(candidates, reader, index, paths, w, group_of)
        loss, grads = evaluator.loss_and_grad(params)
        history.append(loss)
        if loss < best_loss:
            best_w, best_loss = w, loss
        dots = _grad_dots(candidates, reader, index, paths, grads, group_of, len(layers))
        grad_logits = w * (dots - np.sum(w * dots, axis=0, keepdims=True))  # softmax Jacobian
        updates, opt_state = opt.update(jnp.asarray(grad_logits, jnp.float32), opt_state)
        logits = optax.apply_updates(logits, updates)
    return best_w, group_of, history
