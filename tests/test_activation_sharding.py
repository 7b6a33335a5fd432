"""Activation logical axes apart from the weights' (capibara_exp/base/logical_axes.py).

The rules put the residual stream where each layout says, under FSDP too; on 8 simulated
CPU devices an FSDP x tensor mesh (data 2 x model 4, parameters over both) trains to the
single-device loss with every activation layout and holds less per device under `tensor`
than under `batch` (XLA's memory analysis of the compiled step, remat `full`: what each
layer saves is the residual stream); the planner compiles an FSDP x tensor candidate for a
TPU topology with a smaller peak under `tensor` than under `batch`.
"""

from __future__ import annotations

import json

import pytest
from jax.sharding import PartitionSpec as P

from capibara_exp.base import logical_axes as axes
from capibara_exp.runtime import partitioning
from tests.conftest import needs_libtpu

LAYOUTS = axes.ACTIVATION_SHARDINGS
RTOL = 2e-6  # tests/test_mesh.py's: float32 sums reduced in another order on each mesh


def fsdp_rules(layout: str, moe: bool = False) -> tuple:
    return partitioning.standard_logical_axis_rules(
        parameter_partitioning_dims=2, additional_rules=axes.activation_axis_rules(layout, moe))


@pytest.mark.parametrize("layout, residual, query, hidden", [
    ("batch", P("data", None, None), P("data", None, "model", None), P("data", None, "model")),
    ("tensor", P("data", None, "model"), P("data", None, "model", None),
     P("data", None, "model")),
    ("sequence", P("data", "model", None), P("data", None, "model", None),
     P("data", None, "model")),
])
def test_fsdp_rules_place_activations_apart_from_weights(layout, residual, query, hidden):
    from flax import linen as nn

    rules = fsdp_rules(layout)
    assert nn.logical_to_mesh_axes(axes.RESIDUAL, rules) == residual
    assert nn.logical_to_mesh_axes(axes.QUERY, rules) == query
    assert nn.logical_to_mesh_axes(axes.HIDDEN, rules) == hidden
    # the weights keep FSDP's layout whatever the activations do
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P("data", "model")


def test_rules_without_activation_names_still_split_the_batch():
    """T5X-era rules passed by hand get the `batch` layout for the names they leave out;
    their own choices win."""
    own = (("activation_embed", "model"),) + partitioning.standard_logical_axis_rules()
    rules = partitioning.with_activation_rules(own)
    from flax import linen as nn

    assert nn.logical_to_mesh_axes(axes.RESIDUAL, rules) == P("data", None, "model")
    moe_rules = partitioning.with_activation_rules(partitioning.standard_logical_axis_rules(),
                                                   moe=True)
    assert nn.logical_to_mesh_axes(axes.RESIDUAL, moe_rules) == P(("expert", "data"), None,
                                                                  None)
    with pytest.raises(ValueError, match="partitioning.activation_sharding: 'rows'"):
        axes.activation_axis_rules("rows")


def test_the_conf_key_reaches_the_rules_of_both_engines():
    """partitioning.activation_sharding is a checked conf key, rendered as the additional
    rules of T5X's standard_logical_axis_rules (the local runtime's has the same name)."""
    import gin
    from capibara_exp.composing import config_schema
    from capibara_exp.runtime import gin_utils
    from capibara_exp.tuning import aot
    from tests.conftest import compose_config

    rule = config_schema.rule_for("config", "partitioning.activation_sharding", "batch")
    assert [v for v in LAYOUTS if rule.problem(v)] == [] and rule.problem("rows")
    cfg = compose_config(["experiment=dense_tiny_lm", "partitioning=fsdp"])
    text = aot.render_local_gin(cfg)
    assert "nets.activation_axis_rules.sharding = %ACTIVATION_SHARDING" in text
    assert "ACTIVATION_SHARDING = 'tensor'" in text
    try:
        rules = gin_utils.run_bindings("config.gin", text)["partitioner"].logical_axis_rules
    finally:
        gin.clear_config(clear_constants=True)
    assert ("activation_embed", "model") in rules and ("embed", "data") in rules


def worker() -> dict:
    """Runs on 8 simulated devices (`python -m tests.test_activation_sharding`): two steps
    of test_mesh's dense model, deeper and with remat `full`, on data 2 x model 4 with FSDP
    and on one device, per layout; the compiled step's temporaries per device."""
    from capibara_exp.runtime.trainer import Trainer

    report: dict = {}
    for layout in LAYOUTS:
        for name, single in (("single", True), ("2x4", False)):
            p = partitioning.PjitPartitioner(num_partitions=4,
                                             logical_axis_rules=fsdp_rules(layout))
            report[f"{layout}/{name}"] = _run(p, Trainer, single)
    return report


def _run(partitioner, trainer_cls, single: bool) -> dict:
    import jax
    import numpy as np
    import optax
    import seqio
    from jax.sharding import Mesh

    from capibara_exp.nets import Decoder, DecoderConfig
    from capibara_exp.runtime import models, optimizers
    from capibara_exp.runtime.state import initial_state
    from tests.test_mesh import _batch

    cfg = DecoderConfig(vocab_size=64, emb_dim=64, num_heads=8, head_dim=8, num_layers=4,
                        mlp_dim=128, remat_policy="full")
    model = models.DecoderOnlyModel(Decoder(cfg), seqio.PassThroughVocabulary(64),
                                    optimizers.OptaxWrapper(optax.adam(1e-2)))
    if single:
        partitioner.mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                                partitioner.mesh.axis_names)
    state, state_axes = initial_state(model, jax.random.PRNGKey(0), 8, 16)
    trainer = trainer_cls(model=model, train_state=state, partitioner=partitioner,
                          eval_names=[], summary_dir=None, train_state_axes=state_axes,
                          rng=jax.random.PRNGKey(1), learning_rate_fn=lambda step: 1e-2,
                          num_microbatches=None)
    state = jax.device_put(state, trainer.state_shardings)
    placed = jax.device_put(_batch(), partitioner.data_sharding())
    with partitioner.activation_context():
        memory = trainer.lower_train_step(state, placed).compile().memory_analysis()
    losses = []
    for _ in range(2):
        state, metrics = trainer.train_step(state, placed)
        losses.append(float(metrics["loss_sum"]))
    return {"losses": losses, "temp_bytes": memory.temp_size_in_bytes}


@pytest.fixture(scope="module")
def report() -> dict:
    from tests.test_mesh import worker_report

    return worker_report("tests.test_activation_sharding")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp_x_tensor_mesh_trains_to_the_single_device_loss(report, layout):
    got = report[f"{layout}/2x4"]["losses"]
    assert got == pytest.approx(report[f"{layout}/single"]["losses"], rel=RTOL)
    assert got == pytest.approx(report["batch/single"]["losses"], rel=RTOL)


@pytest.mark.slow
def test_residual_stream_over_the_tensor_axis_holds_less_per_device(report):
    """`tensor` saves each layer's input split 4 ways. (`sequence` saves it split too, but
    on this small model the gathers of the length before attention cost more than that:
    bench/RESULTS.md has both figures.)"""
    assert report["tensor/2x4"]["temp_bytes"] < report["batch/2x4"]["temp_bytes"]


# A scanned 16-layer decoder whose saved layer inputs are a large share of its peak.
MEDIUM = ["experiment=dense_tiny_lm", "topology=v5e-4", "partitioning=fsdp",
          "partitioning.num_partitions=2", "model.emb_dim=1024", "model.num_heads=8",
          "model.head_dim=128", "model.mlp_dim=2048", "model.num_layers=16",
          "model.scan_layers=true", "model.position_embedding=rope", "model.attention=splash",
          "model.remat_policy=full", "model.dtype=bfloat16",
          "data.task_feature_lengths={targets: 2048}", "data.batch_size=16"]


@pytest.mark.slow
@needs_libtpu
def test_the_planner_compiles_fsdp_x_tensor_with_a_smaller_peak_under_tensor():
    """The planner's own compile (aot.compile_step) of an FSDP 2 x tensor 2 candidate for
    v5e-4: XLA's peak per chip is lower with the residual stream split over 'model'."""
    from capibara_exp.base import topologies
    from capibara_exp.tuning import aot, tpu_slice
    from tests.conftest import compose_config

    target = topologies.get("v5e-4")
    devices = tpu_slice.devices(target)
    peaks = {}
    for layout in ("batch", "tensor"):
        cfg = compose_config([*MEDIUM, f"partitioning.activation_sharding={layout}"])
        compiled = aot.compile_step(cfg, devices, target.chip)
        assert compiled.feasible, compiled.reason
        peaks[layout] = compiled.memory_bytes
    assert peaks["tensor"] < peaks["batch"]


if __name__ == "__main__":
    print(json.dumps(worker()))
