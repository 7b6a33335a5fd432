"""An experiment's libtpu flags (`libtpu_init_args`) are part of its composed config and
reach libtpu in the planner's ahead-of-time compiles: a flag libtpu does not know stops it
with its own message, a known one compiles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_libtpu

PROBE = """
import sys
import jax, jax.numpy as jnp
from capibara_exp.tuning import plan
devices, chip, where = plan.target("v5e-1", "float32", sys.argv[1])
place = jax.sharding.SingleDeviceSharding(devices[0])
jax.jit(lambda x: x * 2, in_shardings=place, out_shardings=place).lower(
    jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=place)).compile()
print("compiled for", where)
"""


def probe(flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, flags], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parent.parent)


def test_the_flags_are_a_conf_key_of_the_run():
    from tests.conftest import compose_config

    assert compose_config([])["libtpu_init_args"] == ""
    cfg = compose_config(["libtpu_init_args='--xla_enable_async_all_gather=true'"])
    assert cfg.libtpu_init_args == "--xla_enable_async_all_gather=true"


@needs_libtpu
@pytest.mark.parametrize("flags, compiles", [
    ("--xla_enable_async_all_gather=true", True),
    ("--xla_tpu_no_such_flag_27=true", False),
])
def test_the_planners_compiles_run_under_the_experiments_flags(flags, compiles):
    out = probe(flags)
    if compiles:
        assert out.returncode == 0 and "compiled for v5e-1" in out.stdout, out.stderr[-2000:]
    else:
        assert out.returncode != 0
        assert "Unknown command line flag 'xla_tpu_no_such_flag_27'" in out.stderr


def test_cached_compiles_are_reused_only_under_the_same_flags(tmp_path):
    """The planner's result cache keys on the compile context (the experiment with its libtpu
    flags, the compiler versions): a search in the same output dir with other flags compiles
    again, and the other flags' results stay in the file for when they come back."""
    from capibara_exp.tuning import mesh_space, plan, search
    from tests.conftest import compose_config

    plain = plan.compile_context(plan.experiment_config(compose_config([])))
    flagged = plan.compile_context(plan.experiment_config(compose_config(
        ["libtpu_init_args='--xla_enable_async_all_gather=true'"])))
    assert plain != flagged
    cand = mesh_space.candidates(4, num_heads=4, num_experts=None, batch_size=8,
                            num_microbatches=[1], remat_policies=["full"], fsdp=[True])[0]
    path = tmp_path / plan.CACHE
    search.Cache(path, plain).put(cand, {"feasible": True, "est_mfu": 0.4})
    other = search.Cache(path, flagged)
    assert other.results == {} and other.stale == 1
    other.put(cand, {"feasible": True, "est_mfu": 0.5})
    other.rewrite()
    assert search.Cache(path, plain).results[cand].record["est_mfu"] == 0.4
    assert search.Cache(path, flagged).results[cand].record["est_mfu"] == 0.5
    assert search.Cache(path, plain).stale == 1
