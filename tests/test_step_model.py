"""The mesh planner's step-time model: the HLO read as a schedule, collectives over ICI and
DCN, splash kernels, the topology table, and the calibration against MaxText's results."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capibara_exp.base import meshes, topologies
from capibara_exp.tuning import calibration, costs, estimate, hlo, profile, tpu_slice
from tests.conftest import needs_libtpu

# A chip with round numbers: 100 FLOP/s, 10 B/s of HBM, links of 10 B/s each way, 5 B/s DCN.
CHIP = topologies.Chip("test", peak_flops=100.0, hbm_bytes=1e9, hbm_bytes_per_s=10.0,
                       ici_bytes_per_s=40.0, ici_ports=2, dcn_bytes_per_s=5.0)
NO_LATENCY = estimate.StepModel(collective_latency_s=0.0)


def tpu_devices(name: str) -> list:
    assert tpu_slice.libtpu_installed(), tpu_slice.INSTALL_HINT  # installed by the test extra
    return tpu_slice.devices(topologies.get(name))


def collective(op: str, nbytes: float, group: int, axes: int = 1, slices: int = 1) -> dict:
    return dataclasses.asdict(profile.Collective(op, nbytes, group, axes, slices))


def test_matmul_flops_and_loop_trip_counts_on_cpu():
    def chain(x_BxD, w_DxF, v_FxD):
        return jnp.tanh(x_BxD @ w_DxF) @ v_FxD

    def scanned(x_BxD, w_DxF, v_FxD):
        def body(x, _):
            return chain(x, w_DxF, v_FxD), None

        return jax.lax.scan(body, x_BxD, None, length=5)[0]

    args = (jnp.ones((32, 64)), jnp.ones((64, 128)), jnp.ones((128, 64)))
    one = 2 * 32 * 64 * 128 * 2  # two matmuls
    compiled = jax.jit(chain).lower(*args).compile()
    assert profile.profile(compiled.as_text(), 1).flops == one
    looped = jax.jit(scanned).lower(*args).compile()
    step = profile.profile(looped.as_text(), 1)
    assert step.flops == 5 * one  # XLA's cost_analysis counts the body once
    assert looped.cost_analysis()["flops"] < 2 * one
    assert step.hbm_bytes > 5 * 4 * (32 * 64)  # at least the carry, read each iteration
    assert [e[0] for e in step.programs[step.entry]].count("loop") == 1
    # The profile is plain data: it survives JSON with the same totals.
    again = profile.StepProfile.from_json(json.loads(json.dumps(step.to_json())))
    assert (again.flops, again.hbm_bytes) == (step.flops, step.hbm_bytes)


def test_a_scan_over_stacked_weights_reads_each_layer_once():
    layers, d = 16, 256
    w = jnp.ones((layers, d, d))

    def scanned(x_BxD, w_LxDxD):
        return jax.lax.scan(lambda x, w_DxD: (jnp.tanh(x @ w_DxD), None), x_BxD, w_LxDxD)[0]

    step = profile.profile(jax.jit(scanned).lower(jnp.ones((8, d)), w).compile().as_text(), 1)
    layer_bytes = d * d * 4
    # Each iteration reads its layer's slice (the CPU backend copies it out, then the dot
    # reads the copy: about 3 layers' bytes), not the whole stack (16 layers' bytes).
    assert 2 * layers * layer_bytes <= step.hbm_bytes < 4 * layers * layer_bytes
    assert step.flops == layers * 2 * 8 * d * d


def test_instructions_whose_attributes_span_lines_are_read_whole():
    text = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}, lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %copy = f32[8,4]{1,0} copy(%dot.1)
}
"""
    comps = hlo.parse(text)
    dot = comps["main"].instructions[2]
    assert dot.opcode == "dot" and "lhs_contracting_dims={1}" in dot.attrs
    assert [i.name for i in comps["main"].instructions] == ["p0", "p1", "dot.1", "copy"]
    assert profile.profile(text, 1).flops == 2 * 8 * 4 * 16


def test_replica_groups_in_every_spelling_and_what_they_span():
    assert costs.group_members("replica_groups=mesh['a'=4,'b'=2] {'a'}, x", 8) == [0, 2, 4, 6]
    assert costs.group_members("replica_groups=mesh['a'=4,'b'=2] {'b'}, x", 8) == [0, 1]
    assert costs.group_members("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [0, 4]
    assert costs.group_members("replica_groups=[2,4]<=[8], x", 8) == [0, 1, 2, 3]
    assert costs.group_members("replica_groups={{0,2},{1,3}}, x", 4) == [0, 2]
    assert costs.group_members("source_target_pairs={{3,0},{0,1}}", 4) == [3, 0]
    assert costs.group_members("replica_groups={}", 3) == [0, 1, 2]
    # (x, y, z, slice) of 8 devices: a 2x2 grid, twice (two slices).
    coords = [(x, y, 0, s) for s in range(2) for y in range(2) for x in range(2)]
    assert costs.span([0, 1], coords) == (1, 1)  # along x
    assert costs.span([0, 1, 2, 3], coords) == (2, 1)  # the whole slice
    assert costs.span([0, 4], coords) == (1, 2)  # the same chip of both slices
    assert costs.span([0, 1], None) == (1, 1)  # host devices: no coordinates


def test_causal_splash_visits_the_blocks_at_or_before_the_diagonal():
    assert costs.causal_block_fraction(2048, 512, 512) == 10 / 16
    assert costs.causal_block_fraction(128, 128, 128) == 1.0
    assert costs.causal_block_fraction(1024, 512, 256) == 6 / 8


def test_collectives_use_every_torus_axis_they_span_and_the_dcn_across_slices():
    def seconds(**kw):
        return estimate.collective_seconds(collective(**kw), CHIP, NO_LATENCY)

    # A ring along one axis: each chip sends on 2 links of 10 B/s; (g-1)/g of the data.
    assert seconds(op="all-gather", nbytes=80.0, group=4) == pytest.approx(0.75 * 80 / 20)
    assert seconds(op="all-reduce", nbytes=80.0, group=4) == pytest.approx(2 * 0.75 * 80 / 20)
    assert seconds(op="all-gather", nbytes=80.0, group=4, axes=2) == pytest.approx(
        0.75 * 80 / 40)  # both axes of a 2x2: twice the links
    assert seconds(op="collective-permute", nbytes=80.0, group=2) == pytest.approx(80 / 10)
    assert seconds(op="all-reduce", nbytes=80.0, group=1) == 0.0
    # Across 2 slices of 4: the slice's ring, then each chip's quarter over DCN (5 B/s).
    within = 2 * 0.75 * 80 / 20
    assert seconds(op="all-reduce", nbytes=80.0, group=8, slices=2) == pytest.approx(
        within + 2 * 0.5 * (80 / 4) / 5)
    assert seconds(op="all-reduce", nbytes=80.0, group=2, slices=2) == pytest.approx(
        2 * 0.5 * 80 / 5)  # pure data parallelism over DCN


def test_the_schedule_plays_sync_async_fused_collectives_and_loops():
    gather = collective("all-gather", 40.0, 2)  # 1 s on the links
    reduce = collective("all-reduce", 40.0, 2)  # 2 s
    step = profile.with_totals(profile.StepProfile("main", {
        "main": [["op", 1000.0, 10.0],  # compute-bound: 10 s
                 ["start", "g", gather],  # hidden behind the next op
                 ["op", 10.0, 100.0],  # memory-bound: 10 s
                 ["done", "g"],
                 ["sync", reduce],  # the core waits 2 s
                 ["overlap", 300.0, 0.0, reduce],  # 3 s of compute hides the 2 s reduce
                 ["loop", "body", 3.0]],
        "body": [["op", 500.0, 0.0], ["start", "b", reduce], ["done", "b"]],  # 5 s + 2 s
    }))
    est = estimate.estimate(step, CHIP, model_flops_per_chip=2000.0, model=NO_LATENCY)
    assert est.step_s == pytest.approx(10 + 10 + 2 + 3 + 3 * 7)
    assert est.roofline_s == pytest.approx(10 + 10 + 3 + 3 * 5)
    assert est.exposed_s == pytest.approx(2 + 3 * 2)
    assert est.collective_s == pytest.approx(1 + 2 + 2 + 3 * 2)
    assert est.mfu == pytest.approx(2000.0 / (est.step_s * 100.0))
    assert step.flops == 1000 + 10 + 300 + 3 * 500 and step.hbm_bytes == 110
    assert step.collective_bytes == 40 * (1 + 1 + 1 + 3)
    # The fitted overlap hides part of a synchronous collective behind its neighbours.
    half = dataclasses.replace(NO_LATENCY, collective_overlap=0.5)
    assert estimate.estimate(step, CHIP, 1.0, half).step_s == pytest.approx(est.step_s - 1)
    slower = dataclasses.replace(NO_LATENCY, mxu_efficiency=0.5)
    assert estimate.estimate(step, CHIP, 1.0, slower).compute_s == pytest.approx(
        2 * est.compute_s)


@needs_libtpu
def test_tpu_einsums_collectives_and_their_torus_axes():
    devices = tpu_devices("v5e-4")
    mesh = Mesh(np.asarray(devices).reshape(2, 2), ("data", "model"))
    coords = [[*d.coords, 0] for d in mesh.devices.flat]

    def step(x_BxLxD, w_DxF):
        h_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, w_DxF)
        scores_BxLxL = jnp.einsum("blf,bmf->blm", h_BxLxF, h_BxLxF)  # a batched einsum
        return jnp.sum(jnp.tanh(scores_BxLxL))  # tanh: no algebraic shortcut for XLA

    x = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data", None, None)))
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "model")))
    compiled = jax.jit(step).lower(x, w).compile()
    got = profile.profile(compiled.as_text(), 4, coords)
    # Per device: 4 of 8 rows, 512 of 1024 features (the scores contract over features, so
    # each device computes partial scores that an all-reduce over 'model' adds up).
    assert got.flops == 2 * 4 * 256 * 512 * 512 + 2 * 4 * 256 * 256 * 512
    reduces = [c for c in got.collectives if c.opcode == "all-reduce"]
    assert reduces and {(c.group_size, c.ici_axes) for c in reduces} <= {(2, 1), (4, 2)}
    assert all(c.slices == 1 for c in got.collectives)


@needs_libtpu
def test_splash_kernels_are_counted_from_their_shapes_and_blocks():
    from flax.linen import partitioning as nn_partitioning

    from capibara_exp.base import logical_axes
    from capibara_exp.nets import splash

    devices = tpu_devices("v5e-4")
    mesh = Mesh(np.asarray(devices).reshape(2, 2), ("data", "model"))
    batch, length, heads, head_dim = 4, 1024, 8, 128

    def loss(q, k, v):
        segments = jnp.ones((batch, length), jnp.int32)
        with nn_partitioning.axis_rules([(logical_axes.BATCH, "data"),
                                         (logical_axes.HEADS, "model")]):
            out = splash.splash_attention(q, k, v, segments)
        return jnp.sum(out.astype(jnp.float32))

    spec = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16,
                                sharding=NamedSharding(mesh, P("data", None, "model", None)))
    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec)
    text = lowered.compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') >= 3  # forward, dq, dkv
    got = profile.profile(text, 4, [[*d.coords, 0] for d in mesh.devices.flat])
    # Per device: 2 sequences x 4 heads; causal blocks of 512 visit 3 of 4; 2 + 3 + 4 matmuls.
    per_matmul = 2 * 2 * 4 * length * length * head_dim * (3 / 4)
    assert got.flops == pytest.approx((2 + 3 + 4) * per_matmul)


@needs_libtpu
def test_two_slices_join_over_dcn_on_the_data_axis():
    from capibara_exp.runtime import partitioning

    devices = tpu_devices("2xv5e-4")
    assert len(devices) == 8 and partitioning.num_slices(devices) == 2
    with partitioning.target_devices(devices):
        dp = partitioning.PjitPartitioner(num_partitions=2)
        with pytest.raises(ValueError, match="only data parallelism crosses slices"):
            partitioning.PjitPartitioner(num_partitions=8)
    assert dict(dp.mesh.shape) == {"data": 4, "model": 2}
    slices = np.vectorize(lambda d: d.slice_index)(dp.mesh.devices)
    assert (slices[:2] == 0).all() and (slices[2:] == 1).all()  # data splits over slices
    assert (slices == slices[:, :1]).all()  # a model group stays within a slice

    def grad_sum(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    mesh = dp.mesh
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    text = jax.jit(grad_sum, out_shardings=NamedSharding(mesh, P())).lower(w, x).compile().as_text()
    coords = [[*d.coords, d.slice_index] for d in mesh.devices.flat]
    got = profile.profile(text, 8, coords).collectives
    # XLA reduces the gradient within each slice over ICI (a reduce-scatter over the slice's
    # 2 data shards), sends its half across the slices over DCN, then gathers it back.
    ici = [(c.opcode, c.bytes, c.slices) for c in got if c.slices == 1]
    dcn = [c for c in got if c.slices == 2]
    assert ("reduce-scatter", 256 * 256 * 4, 1) in ici and ("all-gather", 256 * 256 * 4, 1) in ici
    assert [(c.opcode, c.bytes, c.group_size) for c in dcn] == [("all-reduce", 256 * 256 * 2, 2)]
    chip = topologies.get("2xv5e-4").chip
    assert estimate.collective_seconds(dataclasses.asdict(dcn[0]), chip, NO_LATENCY) == \
        pytest.approx(2 * 0.5 * 256 * 256 * 2 / chip.dcn_bytes_per_s)


@needs_libtpu
def test_every_slice_in_the_table_is_one_libtpu_describes():
    for name, slice_ in topologies.SLICES.items():
        devices = tpu_slice.devices(slice_)  # raises if the count differs
        assert len(devices) == slice_.chips == slice_.chips_per_slice, name
        assert {d.device_kind for d in devices} == {slice_.chip.kind}, name
        assert slice_.chips <= 256 and slice_.hosts * slice_.chips_per_host == slice_.chips
    assert len(tpu_slice.devices(topologies.get("2xv5e-256"))) == 512
    with pytest.raises(ValueError, match="unknown TPU slice 'v5e-3'"):
        topologies.get("v5e-3")
    sizes = {g: sorted(t.chips for t in topologies.SLICES.values() if t.generation == g)
             for g in ("v4", "v5e", "v5p", "v6e")}
    assert sizes["v5e"] == sizes["v6e"] == [1, 4, 8, 16, 32, 64, 128, 256]
    assert sizes["v4"] == sizes["v5p"] and sizes["v5p"][0] == 4 and sizes["v5p"][-1] == 256


def test_the_mesh_rule_names_what_does_not_divide():
    assert meshes.mesh_axes(64, 4) == {"data": 16, "model": 4}
    assert meshes.mesh_axes(64, 1, 16) == {"data": 4, "expert": 16, "model": 1}
    assert meshes.mesh_axes(512, 4, num_slices=2) == {"data": 128, "model": 4}
    with pytest.raises(ValueError, match="num_partitions=3 model partitions do not divide the 8"):
        meshes.mesh_axes(8, 3)
    with pytest.raises(ValueError, match=r"num_expert_partitions=3 does not divide .* = 4"):
        meshes.mesh_axes(8, 2, 3)
    with pytest.raises(ValueError, match="not a multiple of the 4 slices"):
        meshes.mesh_axes(8, 4, num_slices=4)
    with pytest.raises(ValueError, match="batch size 10 does not divide by .*num_microbatches=4"):
        meshes.check_batch(10, 4, 1)
    with pytest.raises(ValueError, match="microbatch size 6 does not divide by the 4 batch"):
        meshes.check_batch(12, 2, 4)
    with pytest.raises(ValueError, match="model.num_heads=6 does not split over a model axis of 4"):
        meshes.check_model_dims({"data": 1, "model": 4}, 6, None)


def test_the_calibrated_model_predicts_each_published_point_from_the_other_three():
    """On the HLO bench/calibrate.py kept for MaxText's four v5e configurations: every
    leave-one-out estimate within 15% of the published MFU (the issue's goal), the shipped
    constants are the fit on all four, and the kept HLO is of the experiments as shipped."""
    chip = topologies.get("v5e-256").chip
    points = calibration.load_points()
    for point in calibration.PUBLISHED:
        meta = json.loads((calibration.DATA_DIR / f"{point.experiment}.json").read_text())
        assert meta["fingerprint"] == calibration.fingerprint(calibration.compose(
            point.experiment)), (f"{point.experiment} changed since its HLO was kept: run "
                                 "`python bench/calibrate.py --compile` and update FITTED")
    for point, _, predicted in calibration.leave_one_out(points, chip):
        assert abs(predicted / point.published.mfu - 1) <= 0.15, point.published.experiment
    fitted = calibration.fit(points, chip)
    for name in calibration.FIT_PARAMETERS:
        assert getattr(fitted, name) == pytest.approx(calibration.FITTED[name], abs=5e-3), name
    def rms(model):
        return np.sqrt(np.mean([np.log(p.estimated_mfu(chip, model) / p.published.mfu) ** 2
                                for p in points]))

    assert rms(fitted) < 0.5 * rms(estimate.DATASHEET)  # the fit explains most of the gap
