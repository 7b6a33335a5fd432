"""The MoE decoder: routing and capacity against hand computations, T5X's sown metrics, the
load-balancing loss, the MoE model's losses, router supervision, and the moe_e2b_tiny run."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio

from capibara_exp import experiment
from capibara_exp.base.errors import ConfigError
from capibara_exp.base.paths import GIN_DIR
from capibara_exp.composing import gin_bridge
from capibara_exp.nets import Decoder, DecoderConfig, MoeConfig, MoeDecoder
from capibara_exp.nets.moe import route, routing_metrics
from capibara_exp.runtime import contrib_moe, gin_utils, metrics, optimizers
from tests.conftest import compose_config
from tests.test_data_routing import built, log_file  # noqa: F401  (the small routing build)

SIZES = dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, num_layers=2, mlp_dim=48)
SHAPE = (2, 12)


def onehot_logits(experts_GxS: list[list[int]], num_experts: int) -> jnp.ndarray:
    """Router logits that pick the given expert for each token (second choice: the next one)."""
    e = np.asarray(experts_GxS)
    logits = np.zeros(e.shape + (num_experts,), np.float32)
    np.put_along_axis(logits, e[..., None], 4.0, axis=-1)
    np.put_along_axis(logits, ((e + 1) % num_experts)[..., None], 2.0, axis=-1)
    return jnp.asarray(logits)


# ----------------------------------------------------------------------------- routing


def test_top1_capacity_drops_late_tokens_and_accounts_for_them() -> None:
    # One group of 6 tokens, 3 experts, capacity 2: expert 0 is chosen by tokens 0,1,2,4,
    # so tokens 2 and 4 (the latest) are dropped; expert 1 takes token 3, expert 2 token 5.
    logits = onehot_logits([[0, 0, 0, 1, 0, 2]], 3)
    real = jnp.ones((1, 6), bool)
    r = route(logits, real, k=1, capacity=2)
    slots = np.argwhere(np.asarray(r.dispatch_GxSxExC[0]))  # (token, expert, slot)
    assert slots.tolist() == [[0, 0, 0], [1, 0, 1], [3, 1, 0], [5, 2, 0]]
    m = routing_metrics(r, real, k=1)
    assert float(m["fraction_tokens_left_behind"]) == pytest.approx(2 / 6)
    assert float(m["expert_usage"]) == pytest.approx(4 / (3 * 2))  # 4 of 6 slots filled
    assert np.allclose(m["expert_load"], [4 / 6, 1 / 6, 1 / 6])
    # Confidence: the kept tokens' gate weights (their top-1 probabilities) over 6 tokens.
    probs = jax.nn.softmax(logits[0], axis=-1)
    kept_probs = [probs[t, e] for t, e in [(0, 0), (1, 0), (3, 1), (5, 2)]]
    assert float(m["router_confidence"]) == pytest.approx(float(sum(kept_probs)) / 6, rel=1e-6)
    # Combine weights are exactly those gates, at the dispatch positions.
    assert np.allclose(r.combine_GxSxExC, r.dispatch_GxSxExC * probs.max(-1)[None, :, None, None])


def test_top2_fills_every_first_choice_before_any_second_choice() -> None:
    # 4 tokens, 2 experts, capacity 2. First choices: 0,0,1,1 fill both experts; every
    # second choice is dropped, although token 0's second choice comes earliest.
    logits = onehot_logits([[0, 0, 1, 1]], 2)
    r = route(logits, jnp.ones((1, 4), bool), k=2, capacity=2)
    assert np.asarray(r.dispatch_GxSxExC[0].sum(-1)).tolist() == [[1, 0], [1, 0], [0, 1], [0, 1]]
    m = routing_metrics(r, jnp.ones((1, 4), bool), k=2)
    assert float(m["fraction_tokens_left_behind"]) == pytest.approx(0.5)  # 4 of 8 assignments
    # With capacity 4 every assignment fits and each token reaches both experts.
    r4 = route(logits, jnp.ones((1, 4), bool), k=2, capacity=4)
    assert np.asarray(r4.dispatch_GxSxExC.sum(-1)).min() == 1


def test_padding_is_never_routed_nor_counted() -> None:
    logits = onehot_logits([[0, 0, 0, 0]], 2)
    real = jnp.asarray([[True, True, False, False]])
    r = route(logits, real, k=1, capacity=1)
    assert float(r.dispatch_GxSxExC.sum()) == 1.0  # token 0 kept, token 1 dropped, pads ignored
    m = routing_metrics(r, real, k=1)
    assert float(m["fraction_tokens_left_behind"]) == pytest.approx(0.5)


def test_capacity_follows_the_factor_and_the_floor() -> None:
    moe_cfg = MoeConfig(num_experts=4, num_selected_experts=2, capacity_factor=1.25,
                        eval_capacity_factor=2.0, min_expert_capacity=3)
    assert moe_cfg.capacity(12, train=True) == 8  # ceil(1.25 * 2 * 12 / 4) = ceil(7.5)
    assert moe_cfg.capacity(12, train=False) == 12
    assert moe_cfg.capacity(2, train=True) == 3  # the floor
    with pytest.raises(ValueError, match="num_selected_experts=5 exceeds num_experts=4"):
        MoeConfig(num_experts=4, num_selected_experts=5)


def test_load_balancing_loss_is_larger_for_a_skewed_router_and_training_balances_it() -> None:
    x_SxD = jax.random.normal(jax.random.PRNGKey(0), (64, 8))
    real = jnp.ones((1, 64), bool)

    def aux_and_load(w_DxE):
        m = routing_metrics(route((x_SxD @ w_DxE)[None], real, 1, 64), real, 1)
        return m["auxiliary_loss"], m["expert_load"]

    # Uniform probabilities give exactly 1; a router leaning on expert 0 gives more.
    assert float(aux_and_load(jnp.zeros((8, 4)))[0]) == pytest.approx(1.0)
    skewed = jnp.zeros((8, 4)).at[:, 0].set(x_SxD.sum(0) / 64 * 50)
    skewed = skewed + 0.01 * jax.random.normal(jax.random.PRNGKey(1), (8, 4))
    aux_skewed, load_skewed = aux_and_load(skewed)
    assert float(aux_skewed) > 1.5 and float(load_skewed.max()) > 0.6

    opt = optax.adam(0.1)
    grad = jax.grad(lambda w: aux_and_load(w)[0])

    def step(_, carry):
        w, opt_state = carry
        updates, opt_state = opt.update(grad(w), opt_state)
        return optax.apply_updates(w, updates), opt_state

    w, _ = jax.jit(lambda w: jax.lax.fori_loop(0, 200, step, (w, opt.init(w))))(skewed)
    aux_after, load_after = aux_and_load(w)
    assert float(aux_after) < 1.1 < float(aux_skewed)
    assert float(load_after.max()) < 0.35, load_after  # from over 0.6 to near 0.25 each


# ----------------------------------------------------------------------------- network


@functools.cache
def moe_net(k: int = 1, interval: int = 2, **moe_kw) -> tuple[MoeDecoder, dict]:
    net = MoeDecoder(DecoderConfig(**SIZES),
                     MoeConfig(num_experts=4, num_selected_experts=k,
                               moe_layer_interval=interval, **moe_kw))
    tokens = jnp.ones(SHAPE, jnp.int32)
    init = jax.jit(functools.partial(net.init, enable_dropout=False))
    return net, init(jax.random.PRNGKey(0), tokens, tokens)


def test_moe_layers_every_n_with_expert_axes_and_t5x_names() -> None:
    net, variables = moe_net(interval=2)
    params, axes = variables["params"], variables["params_axes"]
    assert "expert" not in params["layers_0"]["mlp"]  # dense layer
    assert params["layers_1"]["mlp"]["expert"]["wi_0"].shape == (4, 32, 48)
    assert params["layers_1"]["mlp"]["expert"]["wo"].shape == (4, 48, 32)
    assert axes["layers_1"]["mlp"]["expert"]["wi_0_axes"].names == ("expert", "embed", "expert_mlp")
    assert axes["layers_1"]["mlp"]["router"]["kernel_axes"].names == ("embed", "unmodeled")
    every = MoeDecoder(DecoderConfig(**SIZES), MoeConfig(num_experts=4, moe_layer_interval=1))
    shapes = jax.eval_shape(functools.partial(every.init, enable_dropout=False),
                            jax.random.PRNGKey(0), *(jnp.ones(SHAPE, jnp.int32),) * 2)
    assert all("expert" in shapes["params"][f"layers_{i}"]["mlp"] for i in range(2))


def test_sows_t5x_moe_metrics_and_matches_dense_call_signature() -> None:
    net, variables = moe_net(k=2)
    tokens = jax.random.randint(jax.random.PRNGKey(3), SHAPE, 1, 64)
    apply = jax.jit(functools.partial(net.apply, enable_dropout=False, mutable=["intermediates"]))
    logits, state = apply({"params": variables["params"]}, tokens, tokens,
                          decoder_segment_ids=jnp.ones(SHAPE, jnp.int32),
                          decoder_positions=jnp.broadcast_to(jnp.arange(12), SHAPE))
    assert logits.shape == (*SHAPE, 64) and logits.dtype == jnp.float32
    sown = state["intermediates"]["layers_1"]["mlp"]
    assert set(contrib_moe.MOE_METRICS) <= set(sown)
    means = contrib_moe.layer_means(state["intermediates"])
    assert 0.0 <= float(means["fraction_tokens_left_behind"]) < 1.0
    assert 0.0 < float(means["router_confidence"]) <= 1.0


@pytest.mark.slow
def test_jitter_and_expert_dropout_act_only_in_training() -> None:
    net, variables = moe_net(router_jitter_noise=0.5, expert_dropout_rate=0.5)
    tokens = jax.random.randint(jax.random.PRNGKey(3), SHAPE, 1, 64)

    @functools.partial(jax.jit, static_argnums=1)
    def run(rng, train):
        return net.apply({"params": variables["params"]}, tokens, tokens, enable_dropout=train,
                         rngs={"dropout": jax.random.PRNGKey(rng)})

    assert np.array_equal(run(1, False), run(2, False))
    assert not np.allclose(run(1, True), run(2, True))


# ----------------------------------------------------------------------------- the model


def make_model(module, **kw) -> contrib_moe.MoeDecoderOnlyModel:
    return contrib_moe.MoeDecoderOnlyModel(module, seqio.PassThroughVocabulary(64),
                                   optimizers.OptaxWrapper(optax.sgd(0.1)), **kw)


def lm_batch(labels: bool = False) -> dict:
    tokens = jax.random.randint(jax.random.PRNGKey(5), SHAPE, 1, 64)
    batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
             "decoder_loss_weights": jnp.ones(SHAPE, jnp.float32)}
    if labels:  # one label per sequence: [batch] broadcasts over its tokens
        batch["decoder_domain_id"] = jnp.asarray([1, 3])
    return batch


@pytest.mark.slow
def test_moe_model_adds_the_scaled_aux_losses_and_reports_metrics() -> None:
    net, variables = moe_net()
    params, batch = variables["params"], lm_batch()
    plain, _ = make_model(net).loss_fn(params, batch, None)
    loss, sums = make_model(net, aux_loss_factor=0.5, router_z_loss_factor=0.25).loss_fn(
        params, batch, None)
    _, state = net.apply({"params": params}, batch["decoder_input_tokens"],
                         batch["decoder_target_tokens"], enable_dropout=False,
                         mutable=["intermediates"])
    means = contrib_moe.layer_means(state["intermediates"])
    expected = plain + 0.5 * means["auxiliary_loss"] + 0.25 * means["router_z_loss"]
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(sums["batch_count"]) == 1.0
    for key in ("experts/expert_usage", "experts/layers_1/expert_usage",
                "experts/layers_1/fraction_tokens_left_behind", "experts/layers_1/max_load",
                "experts/layers_1/router_confidence"):
        assert contrib_moe.MEAN + key in sums


def test_moe_model_on_a_dense_module_names_the_missing_metric() -> None:
    dense = Decoder(DecoderConfig(**SIZES))
    params = dense.init(jax.random.PRNGKey(0), *(jnp.ones(SHAPE, jnp.int32),) * 2,
                        enable_dropout=False)["params"]
    with pytest.raises(ValueError, match="sowed no 'auxiliary_loss'"):
        make_model(dense).loss_fn(params, lm_batch(), None)


def test_router_supervision_teaches_routers_the_domain_labels() -> None:
    net, variables = moe_net()
    model = make_model(net, router_label_feature="domain_id", router_supervision_factor=1.0)
    params, batch = variables["params"], lm_batch(labels=True)
    _, sums = model.loss_fn(params, batch, None)
    before = float(sums[contrib_moe.MEAN + "experts/router_supervision_loss"])
    # By hand: the router's log-probability of expert (label mod 4) at every token.
    _, state = net.apply({"params": params}, batch["decoder_input_tokens"],
                         batch["decoder_target_tokens"], enable_dropout=False,
                         mutable=["intermediates"])
    log_p = jax.nn.log_softmax(state["intermediates"]["layers_1"]["mlp"]["router_logits"][0])
    by_hand = -np.mean([log_p[0, :, 1], log_p[1, :, 3]])
    assert before == pytest.approx(float(by_hand), rel=1e-5)

    def supervision(p):
        metrics = model.loss_fn(p, batch, None)[1]
        return metrics[contrib_moe.MEAN + "experts/router_supervision_loss"]

    step = jax.jit(lambda p: jax.tree.map(lambda w, g: w - 0.5 * g, p, jax.grad(supervision)(p)))
    for _ in range(20):
        params = step(params)
    _, sums = model.loss_fn(params, batch, None)
    assert float(sums[contrib_moe.MEAN + "experts/router_supervision_loss"]) < before / 2
    assert float(sums[contrib_moe.MEAN + "experts/router_label_accuracy"]) == 1.0
    with pytest.raises(KeyError, match="no feature 'decoder_domain_id'"):
        model.loss_fn(params, lm_batch(labels=False), None)


# ----------------------------------------------------------------------------- MFU


def test_model_flops_count_the_router_and_k_of_e_experts_as_by_hand() -> None:
    # SIZES at length 12: per layer q, k, v, o are 32 x 32; a gated MLP is wi_0, wi_1 (32 x
    # 48) and wo (48 x 32); layer 1's router is 32 x 4; the logits 32 x 64 (the embedding
    # lookup is no matmul); PaLM's attention term 12 x layers x heads x head_dim x length.
    attention, mlp, router, logits = 4 * 32 * 32, 3 * 32 * 48, 32 * 4, 32 * 64
    attention_term = 12 * 2 * 2 * 16 * 12
    dense = metrics.model_flops_per_token(DecoderConfig(**SIZES), 12)
    assert dense == 6 * (2 * attention + 2 * mlp + logits) + attention_term
    for k in (1, 2):
        moe_cfg = MoeConfig(num_experts=4, num_selected_experts=k)
        got = metrics.model_flops_per_token(DecoderConfig(**SIZES), 12, moe_cfg)
        assert got == 6 * (2 * attention + mlp + router + k * mlp + logits) + attention_term
    # Top-1 over experts as wide as the dense MLP: equal active weights but the router.
    moe_cfg = MoeConfig(num_experts=4, num_selected_experts=1)
    top1 = metrics.model_flops_per_token(DecoderConfig(**SIZES), 12, moe_cfg)
    assert top1 - dense == 6 * router
    # Grouped-query attention: the key and value projections shrink with the heads, and a
    # sliding window of 5 bounds the attention term of the layers that use it (all here).
    gqa = metrics.model_flops_per_token(DecoderConfig(**SIZES, num_kv_heads=1), 12)
    assert dense - gqa == 6 * 2 * 2 * 32 * 16  # 2 layers, k and v lose one head of 16
    windowed = metrics.model_flops_per_token(DecoderConfig(**SIZES, sliding_window=5), 12)
    assert dense - windowed == 12 * 2 * 2 * 16 * (12 - 5)


def test_peak_flops_are_measured_and_stored_in_the_compute_dtype(tmp_path: Path) -> None:
    path = tmp_path / metrics.PEAK_FILE
    path.write_text(json.dumps({"matmul_peak_flops": 1.5e11, "dtype": "float32"}))
    assert metrics.run_peak_flops(tmp_path, "float32") == 1.5e11  # a resume keeps its figure
    bf16 = metrics.run_peak_flops(tmp_path, "bfloat16")  # a bf16 model: measured in bf16
    assert bf16 != 1.5e11 and bf16 > 1e8
    stored = json.loads(path.read_text())
    assert {k: stored[k] for k in ("matmul_peak_flops", "dtype")} == {
        "matmul_peak_flops": bf16, "dtype": "bfloat16"}
    assert stored["method"].startswith("best of 6 jitted 2048x2048x2048 bfloat16 matmuls")


# ----------------------------------------------------------------------------- experiment


def test_moe_e2b_experiments_compose_bridge_and_parse(tmp_path: Path) -> None:
    for name in ("moe_e2b_tiny", "moe_e2b_base"):
        cfg = compose_config([f"experiment={name}"])
        local, t5x = (gin_bridge.render(cfg, e, GIN_DIR) for e in ("local", "t5x"))
        assert gin_bridge.body_of(local) == gin_bridge.body_of(t5x)
        assert "from t5x.contrib.moe import partitioning as moe_partitioning" in t5x
        gin_utils.parse(tmp_path / f"{name}.gin", local)
        import gin

        assert repr(gin.query_parameter("train_script.train.trainer_cls")) == (
            "@moe_trainer.MoeTrainer")
        assert repr(gin.query_parameter("train_script.train.partitioner")) == (
            "@moe_partitioning.MoePjitPartitioner()")


TINY = ["experiment=moe_e2b_tiny", "debug=fast", "model.emb_dim=32", "model.num_heads=2",
        "model.head_dim=16", "model.mlp_dim=64", "data.batch_size=4",
        "data.task_feature_lengths={targets: 64}", "model.loss_normalizing_factor=256.0"]


def test_router_labels_follow_their_segments_on_the_routing_mixture(
        built, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 (a fixture)
    # Real batches of the small routing build: every labelled token belongs to a segment
    # (and every segment token has a label), one label per segment, and a segment that
    # starts an example carries the label of the domain its text header names.
    from capibara_exp.data import routing, routing_tasks
    from capibara_exp.runtime import inputs
    from capibara_exp.runtime.utils import DatasetConfig

    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(built[0]))
    cfg = DatasetConfig(mixture_or_task_name="capibara_e2b_routing",
                        task_feature_lengths={"targets": 64}, split="train", batch_size=4,
                        shuffle=True, seed=3, pack=True, module=routing_tasks.__name__)
    model = make_model(moe_net()[0], router_label_feature="domain_id",
                       router_supervision_factor=0.1)
    labelled = inputs.batches(cfg, model.FEATURE_CONVERTER_CLS, 3)
    plain = inputs.batches(cfg, make_model(moe_net()[0]).FEATURE_CONVERTER_CLS, 3)
    headers = set()
    for _ in range(6):
        batch, same = next(labelled), next(plain)
        assert sorted(batch) == sorted([*same, "decoder_domain_id"])
        for k in same:  # the labels change nothing else
            np.testing.assert_array_equal(batch[k], same[k], err_msg=k)
        labels, segments = batch["decoder_domain_id"], batch["decoder_segment_ids"]
        np.testing.assert_array_equal(labels >= 0, segments != 0)
        for row in range(labels.shape[0]):
            for seg in np.unique(segments[row][segments[row] > 0]):
                at = segments[row] == seg
                assert len(np.unique(labels[row][at])) == 1
                text = bytes(int(t) - 3 for t in batch["decoder_target_tokens"][row][at]
                             if 3 <= t < 259).decode("utf-8", "replace")
                if text.startswith("<domain:"):
                    domain = text[len("<domain:"):].split(">", 1)[0]
                    assert labels[row][at][0] == routing.DOMAINS.index(domain), text[:40]
                    headers.add(domain)
    assert len(headers) >= 2  # the check met examples' starts of several domains


def test_router_labels_need_a_kernel_packer_and_an_integer_feature(
        built, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 (a fixture)
    from capibara_exp.data import packing, routing_tasks
    from capibara_exp.runtime import inputs
    from capibara_exp.runtime.utils import DatasetConfig

    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(built[0]))
    cfg = DatasetConfig(mixture_or_task_name=routing_tasks.domain_task("sql"),
                        task_feature_lengths={"targets": 64}, split="validation", batch_size=2,
                        shuffle=False, seed=0, pack=True, module=routing_tasks.__name__)

    def first(feature: str, strategy: str = "first_fit") -> dict:
        converter = packing.carrying_labels(seqio.DecoderFeatureConverter, feature)
        return next(inputs.batches(cfg, converter, 0, packer=packing.Packer(strategy)))

    with pytest.raises(ValueError, match="set data.pack=true and data.packing=first_fit"):
        first("domain_id", "seqio")
    with pytest.raises(ValueError, match="router_label_feature='nope': the examples have no"):
        first("nope")
    with pytest.raises(ValueError, match="'difficulty': must be one integer per example"):
        first("difficulty")
    batch = first("domain_id", "next_fit")
    np.testing.assert_array_equal(  # sql is domain 1
        batch["decoder_domain_id"], np.where(batch["decoder_segment_ids"] > 0, 1, -1))


@pytest.mark.slow
def test_moe_e2b_tiny_trains_on_its_routing_mixture_with_router_supervision(
        tmp_path: Path, built, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # The experiment's own data (a small build of the routing mixture), debug=fast, EMA
    # (the MoE trainer takes the local engine's features like the dense one) and router
    # supervision from the domain labels; then the plot command draws the expert panels.
    from capibara_exp.cli import run_curves

    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(built[0]))
    cfg = compose_config([f"model_dir={tmp_path}", *TINY, "ema=default",
                          "router_supervision=domain"])
    step, state = gin_utils.run_train(experiment.write_gin(cfg, tmp_path, {}))
    assert step == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "train_eval"]
    assert evals and 0.0 <= evals[-1]["experts/layers_1/fraction_tokens_left_behind"] <= 1.0
    assert 0.0 < evals[-1]["experts/layers_1/expert_usage"] <= 1.0
    assert evals[-1]["experts/layers_1/max_load"] >= 1.0
    for r in (train[-1], evals[-1]):
        assert 0.0 <= r["experts/router_label_accuracy"] <= 1.0
        assert r["experts/router_supervision_loss"] > 0.0
    assert list((tmp_path / "train_eval").glob("events.out.tfevents.*"))
    drawn = run_curves.panels(records)
    assert drawn["experts: max_load per layer"] == ["experts/layers_1/max_load"]
    assert "experts/router_label_accuracy" in drawn
    assert run_curves.render(tmp_path, tmp_path / "curves.png").stat().st_size > 0


def test_router_supervision_is_a_local_only_group() -> None:
    cfg = compose_config(["experiment=moe_e2b_tiny", "router_supervision=domain"])
    with pytest.raises(ConfigError, match="router_supervision: the local engine's"):
        gin_bridge.render(cfg, "t5x", GIN_DIR)
    local = gin_bridge.render(cfg, "local", GIN_DIR)
    assert "ROUTER_LABEL_FEATURE = 'domain_id'  # router_supervision.router_label_feature" in local


def test_a_kept_peak_from_before_boot_or_beaten_by_a_probe_is_measured_again(
        tmp_path: Path) -> None:
    """A kept MFU baseline holds only if measured since the machine booted and not beaten
    by a quick probe now (one measured on a busy machine is)."""
    import time

    from capibara_exp import experiment

    path = tmp_path / metrics.PEAK_FILE

    def kept(peak: float, measured_at: float) -> bool:
        path.write_text(json.dumps({"matmul_peak_flops": peak, "dtype": "float32",
                                    "measured_at": measured_at}))
        return experiment.peak_still_true(path, "float32")

    assert experiment.boot_time() > 0  # Linux: /proc/stat's btime
    assert not kept(1e30, experiment.boot_time() - 60)  # before this boot
    assert not kept(1.0, time.time())  # 1 FLOP/s: measured while the machine was busy
    assert kept(1e30, time.time())  # since boot, and no probe beats it
