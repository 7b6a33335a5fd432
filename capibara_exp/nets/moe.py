"""A mixture-of-experts decoder: nets.Decoder with a sparse feed-forward block every N layers.

Token-choice routing (top-1 as in Switch, or top-k) inside token groups (one group per
sequence), a fixed expert capacity per group with dropped-token accounting, router jitter
noise and expert dropout. Each MoE block sows T5X's MoE metric names into 'intermediates'
(`auxiliary_loss`, `router_z_loss`, `fraction_tokens_left_behind`, `expert_usage`,
`router_confidence`), so t5x.contrib.moe's MoeDecoderOnlyModel and the local runtime's
both add the auxiliary losses. It also sows `expert_load` (share of assignments per expert)
and `router_logits` (for router supervision from domain labels).

Expert weights carry 'expert' as their first logical axis and live under `.../expert/`
(T5X's MoeTrainer and Adafactor match `.*expert.*`). Shape suffixes as in nets.decoder, plus
G token groups, S tokens per group, E experts, C expert capacity, K experts per token.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from capibara_exp.base import logical_axes as axes
from capibara_exp.base import model_facts
from capibara_exp.nets.decoder import (
    _ACTIVATIONS,
    Decoder,
    DecoderConfig,
    DecoderLayer,
    Dense,
    LayerSpec,
    constrain,
    param_with_axes,
    remat_layer,
)

# Logical names of the expert computation; t5x.contrib.moe's rules map them to mesh axes.
TOKENS = axes.RESIDUAL  # the residual stream, as the dense layers name it
GROUPED = ("batch", "unmodeled", "length", "embed")
BY_EXPERT = ("expert", "expert_replicas", "length", "embed")
BY_EXPERT_HIDDEN = ("expert", "expert_replicas", "length", "expert_mlp")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts options; gin binds them (nets.MoeConfig.num_experts = 8)."""

    num_experts: int
    num_selected_experts: int = 1  # k of top-k token choice: 1 is Switch routing
    capacity_factor: float = 1.25  # slots per expert = ceil(factor * k * tokens / experts)
    eval_capacity_factor: float = 2.0
    min_expert_capacity: int = 1
    moe_layer_interval: int = 2  # layer i is sparse when (i + 1) % interval == 0
    router_jitter_noise: float = 0.0  # router input scaled by U(1 - noise, 1 + noise) in training
    expert_dropout_rate: float = 0.0  # dropout on the experts' hidden units
    # A token's k gate weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob);
    # off: the router's softmax probabilities as they are (Switch, GShard).
    renormalize_top_k: bool = False
    # Every token served by its k experts, no capacity (Mixtral's and Qwen-MoE's own
    # computation): tokens sorted by expert and multiplied group by group (lax.ragged_dot).
    # The capacity factors are unused; expert weights are not split over an expert axis.
    dropless: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_selected_experts", "min_expert_capacity",
                     "moe_layer_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_selected_experts > self.num_experts:
            raise ValueError(f"MoeConfig.num_selected_experts={self.num_selected_experts} exceeds "
                             f"num_experts={self.num_experts}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MoeConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.router_jitter_noise < 1.0:
            raise ValueError(
                f"MoeConfig.router_jitter_noise must be in [0, 1), got {self.router_jitter_noise}")
        if not 0.0 <= self.expert_dropout_rate < 1.0:
            raise ValueError(
                f"MoeConfig.expert_dropout_rate must be in [0, 1), got {self.expert_dropout_rate}")

    def is_sparse(self, layer: int) -> bool:
        return (layer + 1) % self.moe_layer_interval == 0

    def capacity(self, tokens_per_group: int, train: bool) -> int:
        """Slots per expert and group: room for `factor` times a perfectly balanced load."""
        factor = self.capacity_factor if train else self.eval_capacity_factor
        balanced = self.num_selected_experts * tokens_per_group / self.num_experts
        return max(self.min_expert_capacity, math.ceil(factor * balanced))


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes: dispatch and combine tensors and the accounting behind them."""

    dispatch_GxSxExC: jnp.ndarray  # 1 where token s fills slot c of expert e
    combine_GxSxExC: jnp.ndarray  # the router's gate weight at the same places
    assigned_GxSxE: jnp.ndarray  # 1 where expert e is among a real token's top-k (kept or not)
    probs_GxSxE: jnp.ndarray
    logits_GxSxE: jnp.ndarray


def route(logits_GxSxE: jnp.ndarray, real_GxS: jnp.ndarray, k: int, capacity: int,
          renormalize: bool = False) -> Routing:
    """Top-k token choice with a capacity per expert and group.

    Slots are filled in priority order: every token's first choice (in position order)
    before any token's second choice, so a token loses its k-th expert before another
    token loses its first. Padding tokens (real == 0) are never routed. `renormalize`: a
    token's k gates are divided by their sum.
    """
    probs_GxSxE = jax.nn.softmax(logits_GxSxE.astype(jnp.float32), axis=-1)
    num_experts = probs_GxSxE.shape[-1]
    gates_GxSxK, experts_GxSxK = jax.lax.top_k(probs_GxSxE, k)
    if renormalize:
        gates_GxSxK = gates_GxSxK / jnp.sum(gates_GxSxK, axis=-1, keepdims=True)
    real = real_GxS.astype(jnp.float32)
    chosen_GxSxKxE = jax.nn.one_hot(experts_GxSxK, num_experts) * real[:, :, None, None]
    g, s = real_GxS.shape
    by_priority_GxKSxE = jnp.swapaxes(chosen_GxSxKxE, 1, 2).reshape(g, k * s, num_experts)
    slot_GxKSxE = jnp.cumsum(by_priority_GxKSxE, axis=1) * by_priority_GxKSxE - 1.0
    slot_GxSxKxE = jnp.swapaxes(slot_GxKSxE.reshape(g, k, s, num_experts), 1, 2)
    kept_GxSxKxE = chosen_GxSxKxE * (slot_GxSxKxE < capacity)
    # A slot index of -1 or >= capacity one-hots to zeros: dropped and unchosen alike.
    slot_GxSxKxE = slot_GxSxKxE.astype(jnp.int32)
    slots_GxSxKxExC = jax.nn.one_hot(slot_GxSxKxE, capacity) * kept_GxSxKxE[..., None]
    dispatch = jnp.sum(slots_GxSxKxExC, axis=2)
    combine = jnp.sum(slots_GxSxKxExC * gates_GxSxK[:, :, :, None, None], axis=2)
    return Routing(dispatch, combine, jnp.sum(chosen_GxSxKxE, axis=2), probs_GxSxE, logits_GxSxE)


def routing_metrics(r: Routing, real_GxS: jnp.ndarray, k: int) -> dict[str, jnp.ndarray]:
    """T5X's MoE metrics for one layer, over real tokens; `auxiliary_loss` is Switch's
    load-balancing loss (1 when balanced at k=1, num_experts when all go to one expert)."""
    real = real_GxS.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(real), 1.0)
    num_experts = r.probs_GxSxE.shape[-1]
    share_E = jnp.sum(r.assigned_GxSxE, axis=(0, 1)) / tokens  # tokens choosing e, pre-capacity
    mean_prob_E = jnp.sum(r.probs_GxSxE * real[..., None], axis=(0, 1)) / tokens
    log_z_GxS = jax.nn.logsumexp(r.logits_GxSxE.astype(jnp.float32), axis=-1)
    kept = jnp.sum(r.dispatch_GxSxExC)
    g, _, e, c = r.dispatch_GxSxExC.shape
    return {
        "auxiliary_loss": num_experts * jnp.sum(share_E * mean_prob_E),
        "router_z_loss": jnp.sum(jnp.square(log_z_GxS) * real) / tokens,
        "fraction_tokens_left_behind": 1.0 - kept / (k * tokens),
        "expert_usage": kept / (g * e * c),  # share of all slots filled
        "router_confidence": jnp.sum(r.combine_GxSxExC) / tokens,
        "expert_load": share_E / k,
    }


class ExpertMlp(nn.Module):
    """E gated MLPs applied in parallel: kernels [E, D, F] and [E, F, D], 'expert' first."""

    config: DecoderConfig
    num_experts: int
    dropout_rate: float

    def kernel(self, name: str, shape: tuple[int, int], axes: tuple[str, str]) -> jnp.ndarray:
        init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
        k = param_with_axes(name, init, (self.num_experts, *shape), jnp.float32,
                            axes=("expert", *axes))
        # promote_dtype, Flax's own cast, so a quantized kernel (runtime/lora) stays quantized
        (k,) = nn.dtypes.promote_dtype(k, dtype=self.config.compute_dtype)
        return k

    def project(self, name: str, x_ExGxCxI: jnp.ndarray, features: int,
                axes: tuple[str, str]) -> jnp.ndarray:
        """Each expert's tokens times its kernel `name` [E, I, features]. One method call per
        projection, so that LoRA adapters can be added to it from outside (runtime/lora)."""
        kernel_ExIxO = self.kernel(name, (x_ExGxCxI.shape[-1], features), axes)
        return jnp.einsum("egci,eio->egco", x_ExGxCxI, kernel_ExIxO)

    def project_ragged(self, name: str, x_MxI: jnp.ndarray, sizes_E: jnp.ndarray,
                       features: int, axes: tuple[str, str]) -> jnp.ndarray:
        """Rows grouped by expert (sizes_E[e] rows for expert e, in expert order) times that
        expert's kernel `name`: the dropless form of `project`."""
        kernel_ExIxO = self.kernel(name, (x_MxI.shape[-1], features), axes)
        if type(kernel_ExIxO).__name__ == "QArray":  # a QLoRA base's kernel (qwix)
            import qwix  # only a quantized network gets here

            kernel_ExIxO = qwix.dequantize(kernel_ExIxO)
        return jax.lax.ragged_dot(x_MxI, kernel_ExIxO.astype(x_MxI.dtype), sizes_E)

    @nn.compact
    def __call__(self, x: jnp.ndarray, enable_dropout: bool,
                 sizes_E: jnp.ndarray | None = None) -> jnp.ndarray:
        """x [E, G, C, D] (capacity slots), or [M, D] grouped by expert with sizes_E."""
        c = self.config
        d, f = x.shape[-1], c.mlp_dim
        if sizes_E is None:
            project = self.project
        else:
            def project(name, h, features, axes):
                return self.project_ragged(name, h, sizes_E, features, axes)
        h = None
        for i, act in enumerate(c.mlp_activations):
            name = "wi" if len(c.mlp_activations) == 1 else f"wi_{i}"
            branch = _ACTIVATIONS[act](project(name, x, f, ("embed", "expert_mlp")))
            h = branch if h is None else h * branch
        h = nn.Dropout(self.dropout_rate)(h, deterministic=not enable_dropout)
        if sizes_E is None:
            h = constrain(h, BY_EXPERT_HIDDEN)
        return project("wo", h, d, ("expert_mlp", "embed"))


class MoeBlock(nn.Module):
    """Router -> dispatch to expert slots -> experts -> gate-weighted combine."""

    config: DecoderConfig
    moe: MoeConfig

    @nn.compact
    def __call__(self, x_BxLxD, real_BxL, enable_dropout):
        c, m = self.config, self.moe
        x_GxSxD = constrain(x_BxLxD, TOKENS)  # one token group per sequence
        router_in = x_GxSxD.astype(jnp.float32)
        if enable_dropout and m.router_jitter_noise > 0:
            noise = jax.random.uniform(self.make_rng("dropout"), router_in.shape, jnp.float32,
                                       1.0 - m.router_jitter_noise, 1.0 + m.router_jitter_noise)
            router_in = router_in * noise
        # The router stays float32 (a stable softmax); a small init starts it near uniform.
        logits_GxSxE = Dense(m.num_experts, ("embed", "unmodeled"), jnp.float32, init_scale=0.1,
                             name="router")(router_in)
        self.sow("intermediates", "router_logits", logits_GxSxE)
        if m.dropless:
            return self.dropless(x_GxSxD, logits_GxSxE, real_BxL, enable_dropout)
        capacity = m.capacity(x_GxSxD.shape[1], train=enable_dropout)
        r = route(logits_GxSxE, real_BxL, m.num_selected_experts, capacity, m.renormalize_top_k)
        for name, value in routing_metrics(r, real_BxL, m.num_selected_experts).items():
            self.sow("intermediates", name, value)

        dtype = c.compute_dtype
        # Compute the dispatch with groups sharded, then swap axes and re-constrain, so XLA
        # moves tokens with an all-to-all rather than gathering every token everywhere.
        in_GxExCxD = constrain(
            jnp.einsum("gsec,gsd->gecd", r.dispatch_GxSxExC.astype(dtype), x_GxSxD), GROUPED)
        in_ExGxCxD = constrain(jnp.swapaxes(in_GxExCxD, 0, 1), BY_EXPERT)
        out_ExGxCxD = ExpertMlp(c, m.num_experts, m.expert_dropout_rate, name="expert")(
            in_ExGxCxD, enable_dropout)
        out_ExGxCxD = constrain(out_ExGxCxD, BY_EXPERT)
        out_GxExCxD = constrain(jnp.swapaxes(out_ExGxCxD, 0, 1), GROUPED)
        y_GxSxD = jnp.einsum("gecd,gsec->gsd", out_GxExCxD, r.combine_GxSxExC.astype(dtype))
        return constrain(y_GxSxD, TOKENS)

    def dropless(self, x_GxSxD, logits_GxSxE, real_GxS, enable_dropout):
        """Every token's k experts, no capacity: the (token, expert) pairs sorted by expert,
        each expert's rows multiplied at once (lax.ragged_dot), the gate-weighted sum back."""
        m, (g, s, d) = self.moe, x_GxSxD.shape
        k, e = m.num_selected_experts, m.num_experts
        probs_GxSxE = jax.nn.softmax(logits_GxSxE.astype(jnp.float32), axis=-1)
        gates_GxSxK, experts_GxSxK = jax.lax.top_k(probs_GxSxE, k)
        if m.renormalize_top_k:
            gates_GxSxK = gates_GxSxK / jnp.sum(gates_GxSxK, axis=-1, keepdims=True)
        for name, value in dropless_metrics(probs_GxSxE, logits_GxSxE, gates_GxSxK,
                                            experts_GxSxK, real_GxS).items():
            self.sow("intermediates", name, value)
        experts_N = experts_GxSxK.reshape(-1)  # N = G * S * K pairs, token-major
        order_N = jnp.argsort(experts_N, stable=True)
        rows_N = jnp.repeat(jnp.arange(g * s), k)[order_N]
        sizes_E = jnp.bincount(experts_N, length=e).astype(jnp.int32)
        x_NxD = x_GxSxD.reshape(g * s, d)[rows_N]
        y_NxD = ExpertMlp(self.config, e, m.expert_dropout_rate, name="expert")(
            x_NxD, enable_dropout, sizes_E)
        y_TxKxD = jnp.zeros_like(y_NxD).at[order_N].set(y_NxD).reshape(g * s, k, d)
        weights = (gates_GxSxK * real_GxS[..., None]).reshape(g * s, k, 1).astype(y_NxD.dtype)
        return constrain(jnp.sum(y_TxKxD * weights, axis=1).reshape(g, s, d), TOKENS)


def dropless_metrics(probs_GxSxE, logits_GxSxE, gates_GxSxK, experts_GxSxK, real_GxS):
    """T5X's MoE metrics where no token is dropped: nothing is left behind and every
    assignment is served (expert_usage 1); the balancing and z losses as with capacity."""
    real = real_GxS.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(real), 1.0)
    num_experts, k = probs_GxSxE.shape[-1], gates_GxSxK.shape[-1]
    chosen_GxSxE = jnp.sum(jax.nn.one_hot(experts_GxSxK, num_experts), axis=2) * real[..., None]
    share_E = jnp.sum(chosen_GxSxE, axis=(0, 1)) / tokens
    mean_prob_E = jnp.sum(probs_GxSxE * real[..., None], axis=(0, 1)) / tokens
    log_z_GxS = jax.nn.logsumexp(logits_GxSxE.astype(jnp.float32), axis=-1)
    return {
        "auxiliary_loss": num_experts * jnp.sum(share_E * mean_prob_E),
        "router_z_loss": jnp.sum(jnp.square(log_z_GxS) * real) / tokens,
        "fraction_tokens_left_behind": jnp.zeros((), jnp.float32),
        "expert_usage": jnp.ones((), jnp.float32),
        "router_confidence": jnp.sum(gates_GxSxK * real[..., None]) / tokens,
        "expert_load": share_E / k,
    }


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is a mixture of experts."""

    moe: MoeConfig | None = None

    def mlp_block(self, x_BxLxD, real_BxL, enable_dropout):
        return MoeBlock(self.config, self.moe, name="mlp")(x_BxLxD, real_BxL, enable_dropout)


class MoeDecoder(Decoder):
    """nets.Decoder with every `moe_layer_interval`-th layer's MLP replaced by experts."""

    moe_config: MoeConfig | None = None

    def layer_spec(self, i: int, decode: bool = False, prefill: bool = False) -> LayerSpec:
        if self.moe_config is None:
            raise ValueError("nets.MoeDecoder.moe_config is required (@nets.MoeConfig())")
        if not self.moe_config.is_sparse(i):
            return super().layer_spec(i, decode, prefill)
        return (remat_layer(MoeDecoderLayer, self.config),
                (("moe", self.moe_config), *self.layer_kwargs(i, decode, prefill)))

    def block_size(self) -> int:
        interval = self.moe_config.moe_layer_interval if self.moe_config else 1
        return model_facts.lcm_period(interval, self.config.layer_period)
