"""FedProx (Li et al. 2020): each client minimises its loss plus mu/2 ||w - w_global||^2,
which keeps local steps near the round's global model when clients' data differ.

`ProxModel` wraps the run's model: the round's global parameters are the trainer's frozen
input (trainer.FrozenInputs), placed like the parameters, so a new round's anchor is read
again (`Trainer.reload_frozen`) without compiling the step again. The run's loss is a sum
over its tokens (T5X's), so the proximal term is counted once per token too, as in the
paper's per-example objective.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from capibara_exp.runtime.trainer import FrozenInputs


class ProxModel:
    """The run's model with FedProx's proximal term; everything else is the model's own."""

    def __init__(self, model: Any, mu: float, param_shapes: Any, param_axes: Any):
        if hasattr(model, "frozen_inputs"):
            raise ValueError("fedavg.proximal_mu: the run's model has frozen inputs of its own "
                             "(a LoRA run); run FedProx on a plain model")
        self.base, self.mu = model, float(mu)
        self._shapes, self._axes = param_shapes, param_axes
        self.anchor: Any = None  # the round's global parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def frozen_inputs(self) -> FrozenInputs:
        return FrozenInputs(shapes=self._shapes, axes=self._axes, load=self._load)

    def _load(self, shardings: Any) -> Any:
        if self.anchor is None:
            raise RuntimeError("fedprox.ProxModel: no global parameters set for the round")
        return jax.device_put(self.anchor, shardings)

    def loss_fn(self, params: Any, batch: dict, dropout_rng: Any, frozen: Any = None
                ) -> tuple[jnp.ndarray, dict]:
        loss, sums = self.base.loss_fn(params, batch, dropout_rng)
        sq = sum(jnp.sum(jnp.square(p - a)) for p, a in
                 zip(jax.tree.leaves(params), jax.tree.leaves(frozen), strict=True))
        tokens = sums["weight_sum"] / (getattr(self.base, "loss_normalizing_factor", None) or 1.0)
        return loss + 0.5 * self.mu * sq * tokens, sums
