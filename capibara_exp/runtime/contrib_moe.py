"""t5x.contrib.moe's surface for the local engine: model, partitioner and trainer for MoE.

gin imports this one module under T5X's three aliases (`moe_models`, `moe_partitioning`,
`moe_trainer`), so `moe_models.MoeDecoderOnlyModel`, `moe_partitioning.MoePjitPartitioner`
and `moe_trainer.MoeTrainer` bind here for engine=local and in t5x.contrib.moe for engine=t5x.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from capibara_exp.base import meshes
from capibara_exp.data import packing
from capibara_exp.runtime import partitioning
from capibara_exp.runtime.models import Batch, DecoderOnlyModel
from capibara_exp.runtime.trainer import Trainer
from capibara_exp.runtime.utils import reject_unsupported

# The names t5x.contrib.moe's models average over layers (it fails when one is missing).
MOE_METRICS = ("auxiliary_loss", "router_z_loss", "fraction_tokens_left_behind",
               "expert_usage", "router_confidence")
# Summed metrics with this prefix are means per batch: metrics.summarize divides them by
# the summed `batch_count`, so they average over microbatches, steps and eval batches.
MEAN = "batch_mean/"


def sown_by_layer(intermediates: Any, name: str) -> dict[str, jnp.ndarray]:
    """{layer path: value} of one sown name, e.g. {'layers_1/mlp': auxiliary_loss}."""
    flat = traverse_util.flatten_dict(dict(intermediates))
    found = {"/".join(path[:-1]): jnp.asarray(value[0] if isinstance(value, tuple) else value)
             for path, value in flat.items() if path[-1] == name}
    return dict(sorted(found.items()))


def unscan(intermediates: Any, block_size: int) -> dict:
    """Intermediates of a scanned decoder (layers/layers_<j>/..., stacked over blocks) as the
    unrolled decoder sows them (layers_<b * block_size + j>/...), so metrics name layers
    alike whether or not the decoder scans."""
    flat = traverse_util.flatten_dict(dict(intermediates))
    out = {}
    for path, value in flat.items():
        if len(path) < 2 or path[0] != "layers":
            out[path] = value
            continue
        j = int(path[1].removeprefix("layers_"))
        stacked = value[0] if isinstance(value, tuple) else value
        for b in range(stacked.shape[0]):
            out[(f"layers_{b * block_size + j}", *path[2:])] = (stacked[b],)
    return traverse_util.unflatten_dict(out)


def layer_means(intermediates: Any) -> dict[str, jnp.ndarray]:
    """T5X's MoE metrics averaged over the MoE layers; a missing name is an error."""
    means = {}
    for name in MOE_METRICS:
        values = list(sown_by_layer(intermediates, name).values())
        if not values:
            raise ValueError(f"MoeDecoderOnlyModel: the module sowed no '{name}' into "
                             "intermediates; is it a mixture-of-experts network (nets.MoeDecoder)?")
        means[name] = jnp.mean(jnp.stack(values).astype(jnp.float32))
    return means


def per_layer_metrics(intermediates: Any) -> dict[str, jnp.ndarray]:
    """Expert utilisation, dropped tokens and router confidence per MoE layer."""
    out = {}
    for name in ("expert_usage", "fraction_tokens_left_behind", "router_confidence"):
        for layer, value in sown_by_layer(intermediates, name).items():
            out[f"experts/{layer.split('/')[0]}/{name}"] = value
    for layer, load_E in sown_by_layer(intermediates, "expert_load").items():
        # The busiest expert's share times the number of experts: 1.0 is perfect balance.
        out[f"experts/{layer.split('/')[0]}/max_load"] = jnp.max(load_E) * load_E.shape[-1]
    return out


def router_supervision(intermediates: Any, labels: jnp.ndarray, real_BxL: jnp.ndarray
                       ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(cross-entropy, accuracy) of every MoE router against domain labels ([batch] or
    [batch, length]), over labelled real tokens; label d asks for expert d mod num_experts,
    a negative label for none."""
    logits = list(sown_by_layer(intermediates, "router_logits").values())
    if not logits:
        raise ValueError("MoeDecoderOnlyModel.router_label_feature is set but the module "
                         "sowed no router_logits")
    num_experts = logits[0].shape[-1]
    labels_BxL = jnp.broadcast_to(labels[:, None] if labels.ndim == 1 else labels, real_BxL.shape)
    weight_BxL = (real_BxL & (labels_BxL >= 0)).astype(jnp.float32)
    target_BxL = jnp.where(labels_BxL >= 0, labels_BxL, 0) % num_experts
    tokens = jnp.maximum(jnp.sum(weight_BxL), 1.0)
    xent = accuracy = 0.0
    for logits_BxLxE in logits:
        log_p = jax.nn.log_softmax(logits_BxLxE.astype(jnp.float32), axis=-1)
        picked_BxL = jnp.take_along_axis(log_p, target_BxL[..., None], axis=-1)[..., 0]
        xent += -jnp.sum(picked_BxL * weight_BxL) / tokens
        hit_BxL = jnp.argmax(logits_BxLxE, axis=-1) == target_BxL
        accuracy += jnp.sum(hit_BxL * weight_BxL) / tokens
    return xent / len(logits), accuracy / len(logits)


class MoeDecoderOnlyModel(DecoderOnlyModel):
    """A decoder-only LM whose loss adds the MoE auxiliary losses (T5X's contrib model).

    As in T5X, `aux_loss_factor * mean_layers(auxiliary_loss)` and the router z-loss term
    are added to the token loss as it stands: a sum over tokens unless
    loss_normalizing_factor is set, so the factors weigh more with a normalised loss.
    The local engine also takes `router_label_feature` and `router_supervision_factor` to
    teach the routers (conf: router_supervision=domain): the feature is an integer task
    feature, one label per example (the routing tasks' `domain_id`); the model's feature
    converter asks the input pipeline to carry it per token through packing, as the batch
    feature `decoder_<name>` (-1 on padding), and label d asks for expert d mod E.
    """

    def __init__(self, module: Any, vocabulary: Any, optimizer_def: Any, decode_fn: Any = None,
                 inputs_bidirectional_attention: bool = False, feature_converter_cls: Any = None,
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 loss_normalizing_factor: float | None = None, aux_loss_factor: float = 0.0,
                 router_z_loss_factor: float = 0.0, router_label_feature: str | None = None,
                 router_supervision_factor: float = 0.0):
        super().__init__(module, vocabulary, optimizer_def, decode_fn,
                         inputs_bidirectional_attention, feature_converter_cls, label_smoothing,
                         z_loss, loss_normalizing_factor)
        for name, value in (("aux_loss_factor", aux_loss_factor),
                            ("router_z_loss_factor", router_z_loss_factor),
                            ("router_supervision_factor", router_supervision_factor)):
            if value < 0:
                raise ValueError(f"moe_models.MoeDecoderOnlyModel.{name} must be >= 0, got {value}")
        if router_supervision_factor and not router_label_feature:
            raise ValueError("moe_models.MoeDecoderOnlyModel.router_supervision_factor needs "
                             "router_label_feature (the batch feature holding domain ids)")
        self.aux_loss_factor = aux_loss_factor
        self.router_z_loss_factor = router_z_loss_factor
        self.router_label_feature = router_label_feature
        self.router_supervision_factor = router_supervision_factor
        if router_label_feature:
            self.FEATURE_CONVERTER_CLS = packing.carrying_labels(self.FEATURE_CONVERTER_CLS,
                                                                 router_label_feature)

    def loss_fn(self, params: Any, batch: Batch, dropout_rng: jax.Array | None
                ) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
        logits, state = self._compute_logits(params, batch, dropout_rng,
                                             mutable=["intermediates"])
        loss, sums = self.token_loss(logits, batch)
        inter = state.get("intermediates", {})
        if self.module.config.scan_layers:
            inter = unscan(inter, self.module.block_size())
        means = layer_means(inter)
        aux = self.aux_loss_factor * means["auxiliary_loss"]
        router_z = self.router_z_loss_factor * means["router_z_loss"]
        loss = loss + aux + router_z
        metrics = {"experts/auxiliary_loss": aux, "experts/router_z_loss": router_z,
                   "experts/raw_auxiliary_loss": means["auxiliary_loss"],
                   **{f"experts/{k}": means[k] for k in MOE_METRICS[2:]},
                   **per_layer_metrics(inter)}
        if self.router_label_feature:
            key = packing.label_batch_feature(self.router_label_feature)
            if key not in batch:
                raise KeyError(f"moe_models.MoeDecoderOnlyModel.router_label_feature="
                               f"'{self.router_label_feature}': the batch has no feature '{key}' "
                               f"(features: {sorted(batch)})")
            xent, accuracy = router_supervision(inter, batch[key],
                                                batch["decoder_target_tokens"] > 0)
            loss = loss + self.router_supervision_factor * xent
            metrics.update({"experts/router_supervision_loss": xent,
                            "experts/router_label_accuracy": accuracy})
        sums.update({MEAN + k: v for k, v in metrics.items()}, batch_count=jnp.ones(()))
        return loss, sums


def standard_logical_axis_rules(activation_partitioning_dims: int = 1,
                                parameter_partitioning_dims: int = 1,
                                additional_rules: partitioning.LogicalRules | None = None
                                ) -> tuple[tuple[str, Any], ...]:
    """T5X's MoE rules: experts on 'expert', expert MLPs on 'model', batch on (expert, data)."""
    base = partitioning.standard_logical_axis_rules(activation_partitioning_dims,
                                                    parameter_partitioning_dims)
    rules = [r for r in base if r[0] != "batch"] + [("batch", ("expert", "data"))]
    rules += [("expert", "expert"), ("expert_mlp", "model"), ("expert_replicas", "data"),
              ("unmodeled", None)]
    return tuple(rules + list(additional_rules or []))


class MoePjitPartitioner(partitioning.PjitPartitioner):
    """A ('data', 'expert', 'model') mesh; the batch is split over 'expert' and 'data'.

    T5X silently shrinks the expert axis to a divisor of the data axis; here an expert
    axis that does not divide is an error naming the sizes, so a run gets the mesh it asked for.
    """

    batch_axes = ("expert", "data")
    moe_rules = True

    def __init__(self, num_expert_partitions: int, num_partitions: int | None = None,
                 model_parallel_submesh: Sequence[int] | None = None,
                 params_on_devices: bool = True,
                 logical_axis_rules: partitioning.LogicalRules | None = None,
                 state_filter_fn: Any = None):
        reject_unsupported("moe_partitioning.MoePjitPartitioner", state_filter_fn=state_filter_fn)
        if num_expert_partitions < 1:
            raise ValueError("moe_partitioning.MoePjitPartitioner.num_expert_partitions must be "
                             f">= 1, got {num_expert_partitions}")
        self.num_expert_partitions = num_expert_partitions
        super().__init__(num_partitions, model_parallel_submesh, params_on_devices,
                         logical_axis_rules=logical_axis_rules or standard_logical_axis_rules())

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        return meshes.mesh_axes(num_devices, self.num_model_partitions,
                                self.num_expert_partitions, num_slices=self.num_slices)


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


class MoeTrainer(Trainer):
    """T5X's MoeTrainer: gradients of expert parameters (paths matching `.*expert.*`) are
    scaled by num_expert_partitions, as t5x.contrib.moe does, so both engines train alike.
    The scale makes training depend on the expert partitioning after the first step (under
    SGD or clipping; Adam's update is nearly scale-free)."""

    def __init__(self, model: Any, train_state: Any, partitioner: Any, eval_names: Any,
                 summary_dir: str | None, train_state_axes: Any, rng: jax.Array,
                 learning_rate_fn: Callable[[jnp.ndarray], jnp.ndarray],
                 num_microbatches: int | None, num_expert_partitions: int,
                 sharded_match_fn: Callable[[str], bool] | None = None,
                 weight_metrics_computer: Any = None, **local_features: Any):
        # local_features: the local engine's EMA and skip-step settings, as for Trainer.
        check_expert_mesh(model, partitioner, num_expert_partitions)
        self.num_expert_partitions = num_expert_partitions
        self._is_expert = sharded_match_fn or re.compile(r".*expert.*").fullmatch
        super().__init__(model, train_state, partitioner, eval_names, summary_dir,
                         train_state_axes, rng, learning_rate_fn, num_microbatches,
                         weight_metrics_computer, **local_features)

    def _grads(self, params: Any, batch: dict, rng: jax.Array, frozen: Any = None
               ) -> tuple[Any, dict]:
        grads, sums = super()._grads(params, batch, rng, frozen)
        scale = float(self.num_expert_partitions)
        grads = jax.tree_util.tree_map_with_path(
            lambda p, g: g * scale if self._is_expert(_path_name(p)) else g, grads)
        return grads, sums


def check_expert_mesh(model: Any, partitioner: Any, num_expert_partitions: int) -> None:
    """The trainer, partitioner and network must agree on how experts are split."""
    given = getattr(partitioner, "num_expert_partitions", None)
    if given != num_expert_partitions:
        raise ValueError(f"moe_trainer.MoeTrainer.num_expert_partitions={num_expert_partitions} "
                         f"but the partitioner has num_expert_partitions={given} "
                         "(use moe_partitioning.MoePjitPartitioner with the same value)")
    moe_config = getattr(model.module, "moe_config", None)
    if moe_config is None:
        raise ValueError("moe_trainer.MoeTrainer: the model's module has no moe_config; "
                         "use nets.MoeDecoder")
    experts, axis = moe_config.num_experts, partitioner.mesh.shape["expert"]
    if experts % axis:
        raise ValueError(f"nets.MoeConfig.num_experts={experts} does not split over the mesh's "
                         f"expert axis of {axis} (num_expert_partitions): more expert "
                         "partitions than experts, or not a divisor")
