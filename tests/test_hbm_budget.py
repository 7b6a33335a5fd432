"""The planner's HBM budget: what XLA:TPU says one program may use per chip (re-probed here
through libtpu for every generation), less an optional reserve; no flat margin."""

from __future__ import annotations

import re

import pytest

from capibara_exp.base import topologies
from capibara_exp.base.topologies import GIB
from capibara_exp.tuning import aot
from tests.conftest import needs_libtpu

SMALLEST = {"v5e": "v5e-1", "v6e": "v6e-1", "v4": "v4-8", "v5p": "v5p-8"}


def test_a_published_operating_point_is_admitted():
    """91.2 GiB on a v5p chip: the old 5% margin (90.25 GiB) refused it; XLA allows 95.74."""
    assert aot.hbm_budget(topologies.V5P) >= 91.2 * GIB > 0.95 * topologies.V5P.hbm_bytes
    assert aot.hbm_budget(topologies.V5P, 2 * GIB) == pytest.approx(93.74 * GIB)
    assert aot.hbm_budget(topologies.V5E, 99 * GIB) == 0.0
    cpu = topologies.Chip("cpu", 1e12, 8 * GIB, 1e10, 0.0, 1)  # no XLA figure: capacity
    assert aot.hbm_budget(cpu) == 8 * GIB


@needs_libtpu
@pytest.mark.parametrize("generation", sorted(SMALLEST))
def test_the_table_holds_what_xla_says_a_program_may_use(generation):
    """A program that needs far more than a chip holds: XLA's refusal states the HBM
    available to programs, which must be the table's figure."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from capibara_exp.tuning import tpu_slice

    target = topologies.get(SMALLEST[generation])
    device = tpu_slice.devices(target)[0]
    place = SingleDeviceSharding(device)

    def too_big(x):  # a sort of 256 GiB, which XLA must hold at once
        rows = jax.lax.broadcasted_iota(jnp.float32, (2**14, 2**22), 1) * x[0]
        return jnp.sort(rows, axis=1)[:, :4]

    lowered = jax.jit(too_big, in_shardings=place, out_shardings=place).lower(
        jax.ShapeDtypeStruct((4,), jnp.float32, sharding=place))
    with pytest.raises(Exception, match="available HBM") as err:
        lowered.compile()
    stated = float(re.search(r"available HBM \(([\d.]+)G\)", str(err.value)).group(1))
    assert stated * GIB == pytest.approx(target.chip.usable_hbm_bytes, abs=0.005 * GIB)
