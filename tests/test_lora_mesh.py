"""QLoRA on 8 simulated CPU devices: the nf4 base is an argument of the compiled step,
sharded like the unquantized kernels on data x model and data x expert x model meshes (not
replicated, not a constant of the program), and the losses of two steps equal a
one-device run's.

XLA_FLAGS must be set before JAX starts, so the checks run in one subprocess
(`python -m tests.test_lora_mesh`) that prints a JSON report this module asserts on.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import pytest

from tests.test_mesh import DEVICES, RTOL, _batch, _model, worker_report

KERNELS = {"dense": ["layers_0/self_attention/query/kernel", "layers_0/mlp/wo/kernel"],
           "moe": ["layers_0/self_attention/query/kernel", "layers_1/mlp/expert/wi_0"]}


def _lora(base_model, base_dir: Path, target_axes: list):
    from capibara_exp.runtime import checkpoints
    from capibara_exp.runtime.lora import LoraModel

    if not checkpoints.steps(base_dir):
        import jax
        import numpy as np

        params = base_model.get_initial_variables(jax.random.PRNGKey(0), 8, 16)["params"]
        mgr = checkpoints.manager(base_dir)
        checkpoints.save(mgr, 1, {"state": {"step": np.int32(1)}, "target": params})
        mgr.close()
    return LoraModel(base_model, str(base_dir), rank=4, target_axes=target_axes,
                     quantize_base="nf4", quantize_block_size=16)


def _largest_constant(hlo: str) -> int:
    """Elements of the largest array constant in a compiled program's text."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\S* constant\(", hlo)
    return max([math.prod(int(d) for d in dims.split(",") if d) for dims in shapes] + [1])


def _run(model, partitioner, trainer_cls, single_device: bool, kind: str, **kw) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from capibara_exp.runtime.state import initial_state

    if single_device:
        shape = (1,) * len(partitioner.mesh.axis_names)
        partitioner.mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(shape),
                                partitioner.mesh.axis_names)
    state, axes = initial_state(model, jax.random.PRNGKey(0), 8, 16)
    trainer = trainer_cls(model=model, train_state=state, partitioner=partitioner,
                          eval_names=[], summary_dir=None, train_state_axes=axes,
                          rng=jax.random.PRNGKey(1), learning_rate_fn=lambda step: 1e-2,
                          num_microbatches=None, **kw)
    state = trainer.prepare_state(state)
    batch = jax.device_put(_batch(), partitioner.data_sharding())
    losses = []
    for _ in range(2):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss_sum"]))
    if single_device:
        return {"losses": losses}
    compiled = trainer.lower_train_step(state, batch).compile()
    frozen = trainer.frozen_values()
    base_specs = partitioner.shardings(model.frozen_inputs().axes)  # by the kernels' axes
    return {
        "losses": losses, "mesh": dict(partitioner.mesh.shape),
        "quantized": {k: [str(frozen[k].qvalue.dtype), str(frozen[k].qvalue.sharding.spec),
                          str(frozen[k].scale.sharding.spec)] for k in KERNELS[kind]},
        "kernel_axes": {k: str(base_specs[k].qvalue.spec) for k in KERNELS[kind]},
        "frozen_bytes_per_device": sum(s.data.nbytes for x in jax.tree.leaves(frozen)
                                       for s in x.addressable_shards[:1]),
        "argument_bytes": compiled.memory_analysis().argument_size_in_bytes,
        "largest_constant": _largest_constant(compiled.as_text()),
        "adapter_spec": str(jax.tree.leaves(state.params)[0].sharding.spec),
    }


def worker() -> dict:
    import jax

    from capibara_exp.runtime import contrib_moe, partitioning
    from capibara_exp.runtime.trainer import Trainer

    assert jax.device_count() == DEVICES, jax.devices()
    tmp = Path(tempfile.mkdtemp())
    attention_mlp = [["embed", "joined_kv"], ["joined_kv", "embed"], ["embed", "mlp"],
                     ["mlp", "embed"]]
    experts = [["embed", "joined_kv"], ["expert", "embed", "expert_mlp"],
               ["expert", "expert_mlp", "embed"]]
    # The constant check's control: a program that does capture a 32 x 32 kernel.
    import numpy as np

    kernel = np.random.default_rng(0).normal(size=(32, 32)).astype(np.float32)
    captured = jax.jit(lambda x: x @ kernel).lower(np.ones((4, 32), np.float32)).compile()
    report = {"control_constant": _largest_constant(captured.as_text())}
    for single in (True, False):
        dense = _lora(_model(False), tmp / "dense", attention_mlp)
        report[f"dense_{single}"] = _run(dense, partitioning.PjitPartitioner(num_partitions=2),
                                         Trainer, single, "dense")
        sparse = _lora(_model(True), tmp / "moe", experts)
        report[f"moe_{single}"] = _run(
            sparse, contrib_moe.MoePjitPartitioner(num_expert_partitions=2, num_partitions=2),
            contrib_moe.MoeTrainer, single, "moe", num_expert_partitions=2)
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report("tests.test_lora_mesh")


@pytest.mark.slow
@pytest.mark.parametrize("kind, mesh", [("dense", {"data": 4, "model": 2}),
                                        ("moe", {"data": 2, "expert": 2, "model": 2})])
def test_qlora_base_is_sharded_like_the_kernels_and_trains_as_on_one_device(
        report: dict, kind: str, mesh: dict) -> None:
    got, want = report[f"{kind}_False"], report[f"{kind}_True"]
    assert got["mesh"] == mesh
    for kernel, (dtype, values, scales) in got["quantized"].items():
        assert dtype == "uint4"  # nf4 codes
        assert values == scales == got["kernel_axes"][kernel], kernel  # as the kernel
        assert "model" in values or "expert" in values, kernel  # really split, not replicated
    if kind == "moe":
        assert got["quantized"]["layers_1/mlp/expert/wi_0"][1] == "P('expert', None, 'model')"
    # An argument of the step (its bytes are in the step's arguments), never a constant.
    assert got["argument_bytes"] > got["frozen_bytes_per_device"] > 0
    assert report["control_constant"] == 32 * 32  # the check sees a captured kernel
    assert got["largest_constant"] < 64  # no kernel (>= 32 x 32) is baked into the program
    assert got["losses"] == pytest.approx(want["losses"], rel=RTOL)
    assert got["losses"][0] != got["losses"][1]  # the second step sees trained adapters


if __name__ == "__main__":
    print(json.dumps(worker()))
