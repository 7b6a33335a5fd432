"""Incremental decoding on a data x model mesh of simulated CPU devices: the prefilled and
stepped logits equal one device's full forward, and the cache is sharded as activations
are (by the partitioner's logical axis rules: the batch over 'data').
XLA_FLAGS must be set before JAX starts: the checks run in one subprocess
(`python -m tests.test_decode_mesh`) that prints a JSON report this module asserts on."""

from __future__ import annotations

import json

import pytest

from tests.test_mesh import worker_report

ENTRIES = ["llama3_tiny", "gemma2_tiny", "mixtral_tiny"]


def worker() -> dict:
    import jax
    import numpy as np
    from flax import linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    from capibara_exp.nets.attention import CACHE_AXES
    from capibara_exp.runtime.partitioning import PjitPartitioner
    from tests.test_decoding import LENGTH, PROMPT, full_logits, stepwise_logits, tiny

    partitioner = PjitPartitioner(num_partitions=2)
    report = {"mesh": dict(partitioner.mesh.shape)}
    for entry in ENTRIES:
        keys, net, params = tiny(entry)
        tokens = jax.random.randint(jax.random.PRNGKey(4), (8, LENGTH), 3, keys["vocab_size"])
        want = np.asarray(full_logits(net, params, tokens))
        replicated = NamedSharding(partitioner.mesh, PartitionSpec())
        params, tokens = jax.device_put((params, tokens), replicated)
        with partitioner.activation_context():
            got = np.asarray(stepwise_logits(net, params, tokens, PROMPT))
            ones = jax.numpy.ones_like(tokens)
            _, made = jax.jit(lambda p, t, n=net: n.apply(
                {"params": p}, t, t, enable_dropout=False, decode=True, mutable=["cache"]))(
                params, ones)
        key = made["cache"]["layers_0"]["self_attention"]["cached_key"]
        rules = nn.logical_to_mesh_axes(CACHE_AXES, partitioner.logical_axis_rules)
        spec = list(key.sharding.spec) + [None] * (len(CACHE_AXES) - len(key.sharding.spec))
        report[entry] = {"diff": float(np.max(np.abs(got - want))), "std": float(np.std(want)),
                         "cache_spec": [str(a) for a in spec],
                         "rules_spec": [str(a) for a in rules]}
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report("tests.test_decode_mesh")


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_decoding_on_a_mesh_equals_one_devices_forward(report: dict, entry: str) -> None:
    from tests.test_decoding import TOLERANCE

    assert report["mesh"]["model"] == 2 and report["mesh"]["data"] > 1
    got = report[entry]
    assert got["std"] > 1e-3 and got["diff"] <= TOLERANCE, got
    # [batch, kv_heads, kv, length] placed by the partitioner's logical axis rules, as the
    # activations are: the batch over 'data' at least
    assert got["cache_spec"] == got["rules_spec"] and got["cache_spec"][0] == "data", got


if __name__ == "__main__":
    print(json.dumps(worker()))
