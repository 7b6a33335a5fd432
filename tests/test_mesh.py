"""Sharded training on 8 simulated CPU devices: the step-1 (and step-2) objective on data x
model and data x expert x model meshes equals the single-device one; experts really are split
(expert-sharded weights, all-to-all in the compiled step); impossible meshes are errors
that name their sizes before anything compiles.

The objective is the token loss plus, for MoE, the load-balancing and router z-loss terms
as the model adds them. The MoE reference runs the same config on one device, with
num_expert_partitions=2: MoeTrainer scales expert gradients by it (as T5X does), so step 2
matches only because both runs use the same scale. A run with another expert partitioning
has the same step-1 objective but, with plain SGD or clipping, different updates.

XLA_FLAGS must be set before JAX starts, so the checks run in one subprocess
(`python -m tests.test_mesh`) that prints a JSON report this module asserts on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEVICES = 8
DENSE_MESHES = {"1x8": 8, "2x4": 4, "4x2": 2}  # data x model: num_partitions
MOE_MESH = "2x2x2"  # data x expert x model
# float32 sums over a batch, reduced in a different order on each mesh.
RTOL = 2e-6


def _model(moe_layers: bool, num_heads: int = 8):
    import optax
    import seqio

    from capibara_exp.nets import Decoder, DecoderConfig, MoeConfig, MoeDecoder
    from capibara_exp.runtime import contrib_moe, models, optimizers

    cfg = DecoderConfig(vocab_size=64, emb_dim=32, num_heads=num_heads, head_dim=8,
                        num_layers=2, mlp_dim=64)
    opt = optimizers.OptaxWrapper(optax.adam(1e-2))
    vocab = seqio.PassThroughVocabulary(64)
    if not moe_layers:
        return models.DecoderOnlyModel(Decoder(cfg), vocab, opt)
    net = MoeDecoder(cfg, MoeConfig(num_experts=4, num_selected_experts=2, capacity_factor=1.0))
    return contrib_moe.MoeDecoderOnlyModel(net, vocab, opt, aux_loss_factor=0.1,
                                   router_z_loss_factor=0.01)


def _batch(batch_size: int = 8, length: int = 16) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (batch_size, length)).astype(np.int32)
    tokens[:, -3:] = 0  # padding, so masks and dropped-token accounting are exercised
    return {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
            "decoder_loss_weights": (tokens > 0).astype(np.float32)}


def _run(model, partitioner, trainer_cls, single_device: bool, **trainer_kw) -> dict:
    """Two train steps; the losses, the sharding of one expert kernel, and the compiled text."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from capibara_exp.runtime.state import initial_state

    if single_device:  # the same partitioner class, on a mesh of one device
        shape = (1,) * len(partitioner.mesh.axis_names)
        partitioner.mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(shape),
                                partitioner.mesh.axis_names)
    batch = _batch()
    state, axes = initial_state(model, jax.random.PRNGKey(0), 8, 16)
    trainer = trainer_cls(model=model, train_state=state, partitioner=partitioner,
                          eval_names=[], summary_dir=None, train_state_axes=axes,
                          rng=jax.random.PRNGKey(1), learning_rate_fn=lambda step: 1e-2,
                          num_microbatches=None, **trainer_kw)
    trainer.check_batch_size(8)
    state = jax.device_put(state, trainer.state_shardings)
    placed = jax.device_put(batch, partitioner.data_sharding())
    with partitioner.activation_context():
        hlo = trainer.lower_train_step(state, placed).compile().as_text()
    terms = {"losses": [], "aux": [], "router_z": [], "objective": []}
    for _ in range(2):
        state, metrics = trainer.train_step(state, placed)
        # Per-batch means (one batch): the aux terms exactly as the model adds them.
        aux = float(metrics.get("batch_mean/experts/auxiliary_loss", 0.0))
        router_z = float(metrics.get("batch_mean/experts/router_z_loss", 0.0))
        terms["losses"].append(float(metrics["loss_sum"]))
        terms["aux"].append(aux)
        terms["router_z"].append(router_z)
        terms["objective"].append(float(metrics["loss_sum"]) + aux + router_z)
    expert = state.params.get("layers_1", {}).get("mlp", {}).get("expert", {}).get("wi_0")
    return {**terms, "all_to_all": "all-to-all" in hlo,
            "expert_spec": None if expert is None else str(expert.sharding.spec)}


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def worker() -> dict:
    """Everything that needs the 8 devices, in one process (run as `python -m tests.test_mesh`)."""
    import jax

    from capibara_exp.runtime import contrib_moe, partitioning
    from capibara_exp.runtime.trainer import Trainer

    assert jax.device_count() == DEVICES, jax.devices()
    report: dict = {"dense": {}}
    reference = _run(_model(False), partitioning.PjitPartitioner(), Trainer, single_device=True)
    report["dense_reference"] = reference
    for name, model_parts in DENSE_MESHES.items():
        p = partitioning.PjitPartitioner(num_partitions=model_parts)
        report["dense"][name] = dict(_run(_model(False), p, Trainer, False),
                                     mesh=dict(p.mesh.shape))

    def moe_partitioner():
        return contrib_moe.MoePjitPartitioner(num_expert_partitions=2, num_partitions=2)

    kw = {"num_expert_partitions": 2}
    report["moe_reference"] = _run(_model(True), moe_partitioner(), contrib_moe.MoeTrainer, True,
                                   **kw)
    p = moe_partitioner()
    report["moe"] = dict(_run(_model(True), p, contrib_moe.MoeTrainer, False, **kw),
                         mesh=dict(p.mesh.shape))

    def moe_trainer_on(partitioner, experts_model=None):
        from capibara_exp.runtime.state import initial_state

        model = experts_model or _model(True)
        state, axes = initial_state(model, jax.random.PRNGKey(0), 8, 16)
        contrib_moe.MoeTrainer(model=model, train_state=state, partitioner=partitioner,
                               eval_names=[],
                       summary_dir=None, train_state_axes=axes, rng=jax.random.PRNGKey(1),
                       learning_rate_fn=lambda s: 1e-2, num_microbatches=None,
                       num_expert_partitions=partitioner.num_expert_partitions)

    report["errors"] = {
        "model_axis": _error(lambda: partitioning.PjitPartitioner(num_partitions=3)),
        "expert_axis": _error(lambda: contrib_moe.MoePjitPartitioner(num_expert_partitions=3,
                                                             num_partitions=2)),
        "more_expert_partitions_than_experts": _error(lambda: moe_trainer_on(
            contrib_moe.MoePjitPartitioner(num_expert_partitions=8))),
        "batch": _error(lambda: moe_partitioner().check_batch_size(6)),
        "heads": _error(lambda: _run(_model(False, num_heads=4),
                                     partitioning.PjitPartitioner(num_partitions=8), Trainer,
                                     False)),
        "batch_dense": _error(
            lambda: partitioning.PjitPartitioner(num_partitions=2).check_batch_size(6)),
    }
    return report


def worker_report(module: str) -> dict:
    """The JSON report of `python -m <module>` run on DEVICES simulated CPU devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", module], env=env, text=True,
                         capture_output=True, cwd=Path(__file__).parent.parent, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return worker_report("tests.test_mesh")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(DENSE_MESHES))
def test_dense_loss_on_a_data_model_mesh_equals_one_device(report: dict, mesh: str) -> None:
    got, want = report["dense"][mesh], report["dense_reference"]
    data, model = (int(n) for n in mesh.split("x"))
    assert got["mesh"] == {"data": data, "model": model}
    assert got["objective"] == got["losses"]  # dense: the token loss is the objective
    assert got["losses"] == pytest.approx(want["losses"], rel=RTOL)


@pytest.mark.slow
def test_moe_loss_on_a_data_expert_model_mesh_equals_one_device(report: dict) -> None:
    got, want = report["moe"], report["moe_reference"]
    assert got["mesh"] == {"data": 2, "expert": 2, "model": 2}
    assert all(a > 0 for a in got["aux"] + got["router_z"])  # the terms are really there
    for term in ("objective", "losses", "aux", "router_z"):
        assert got[term] == pytest.approx(want[term], rel=RTOL), term
    # Expert kernels [E, D, F] split over experts and the model axis; tokens move by all-to-all.
    assert got["expert_spec"] == "P('expert', None, 'model')"
    assert got["all_to_all"] and not want["all_to_all"]


@pytest.mark.slow
def test_impossible_meshes_are_errors_naming_the_sizes(report: dict) -> None:
    e = report["errors"]
    assert "num_partitions=3" in e["model_axis"] and "8 available devices" in e["model_axis"]
    assert "num_expert_partitions=3" in e["expert_axis"] and "= 4" in e["expert_axis"]
    assert "num_experts=4" in e["more_expert_partitions_than_experts"]
    assert "expert axis of 8" in e["more_expert_partitions_than_experts"]
    assert "batch size 6" in e["batch"] and "4 batch shards" in e["batch"]
    assert "batch size 6" in e["batch_dense"] and "4 batch shards" in e["batch_dense"]
    # 4 heads cannot split over 8 model partitions: named before compiling.
    assert "['relpos_bias']['rel_embedding'] of shape (4, 32)" in e["heads"]
    assert "logical axis 'heads'" in e["heads"] and "('model',) of size 8" in e["heads"]


if __name__ == "__main__":
    print(json.dumps(worker()))
