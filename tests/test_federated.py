"""Federated rounds as Flower users know them, on a real tiny run's model and task: client
sampling, a start from a checkpoint, FedProx, server optimisers (against Flower's update
rules written out here), registry aggregators against poisoned clients, and DP with the
noise multiplier solved for a target epsilon, warned about when it drowns the update."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from capibara_exp.consensus import dp, federated, fedopt, run, store, validation
from capibara_exp.consensus.fedconfig import FedConfig
from capibara_exp.runtime import lineage
from tests.test_train import train


@pytest.fixture(scope="module")
def parts(tmp_path_factory, data_dir) -> dict:
    root = tmp_path_factory.mktemp("fed")
    train(root / "run", "trainer.train_steps=3", "trainer.eval_period=3",
          "checkpoint.checkpoint_period=3", "trainer.eval_steps=2")
    config_gin = root / "run" / "config.gin"
    p = run.load_parts(config_gin)
    selection, _ = validation.from_parts(p, 2, 0)
    return {"root": root, "parts": p, "evaluator": selection,
            "checkpoint": root / "run" / "checkpoint_3"}


def rounds(parts: dict, tmp_path: Path | None = None, **kw) -> dict:
    """Rounds from the trained checkpoint (past the schedule's warm-up) unless told."""
    cfg = FedConfig(**{"num_clients": 4, "rounds": 2, "local_steps": 1,
                       "initial_checkpoint": str(parts["checkpoint"]), **kw})
    return federated.fedavg(parts["parts"], cfg, parts["evaluator"], tmp_path)[1]


def test_clients_are_sampled_per_round_as_flower_does(parts) -> None:
    rep = rounds(parts, fraction_fit=0.5, rounds=3)
    assert [len(r["clients"]) for r in rep["rounds"]] == [2, 2, 2]  # int(4 x 0.5)
    assert len({tuple(r["clients"]) for r in rep["rounds"]}) > 1  # a new draw each round
    assert rep["sampling_rate"] == 0.5
    assert fedopt.num_fit_clients(10, 0.1, 2) == 2 and fedopt.num_fit_clients(10, 0.5, 2) == 5
    with pytest.raises(ValueError, match=r"fedavg.min_fit_clients must be at most "
                                         r"num_clients=4, got 5"):
        FedConfig(min_fit_clients=5)


def test_rounds_start_from_a_checkpoint_and_record_it(parts, tmp_path) -> None:
    rep = rounds(parts, tmp_path)
    assert rep["rounds"][0]["first_step"] == 3
    cand = store.candidate_from_path(parts["checkpoint"])
    with store.LeafReader() as reader:
        params = reader.read_subtree(cand, store.leaf_index(cand), ("target",))
    assert rep["start_val_loss"] == pytest.approx(parts["evaluator"].loss(params), rel=1e-6)
    scratch = rounds(parts, rounds=1, initial_checkpoint=None)
    assert scratch["rounds"][0]["first_step"] == 0
    assert rep["start_val_loss"] < scratch["start_val_loss"]  # trained, not the init
    written = lineage.of_checkpoint(Path(rep["checkpoint"]))
    assert written[0]["from"] == f"checkpoint {parts['checkpoint']}"


def test_fedprox_keeps_clients_near_the_global_model(parts) -> None:
    # From a trained checkpoint (the schedule is past its warm-up), 3 local steps: the
    # first starts at the anchor, where the proximal term has no gradient yet.
    start = {"rounds": 1, "local_steps": 3}
    plain = rounds(parts, **start)
    prox = rounds(parts, **start, proximal_mu=100.0)
    assert 0 < prox["rounds"][0]["update_norm"] < 0.9 * plain["rounds"][0]["update_norm"]


def _flower_reference(name: str, hp: dict, x: np.ndarray, deltas: list[np.ndarray]) -> np.ndarray:
    """Flower's FedAdam / FedYogi / FedAvgM server updates, round by round."""
    m = v = mom = None
    for t, d in enumerate(deltas, start=1):
        if name == "fedavgm":
            g = -d
            if hp["server_momentum"] > 0:
                mom = g if mom is None else hp["server_momentum"] * mom + g
                g = mom
            x = x - hp["server_learning_rate"] * g
            continue
        m = (1 - hp["beta_1"]) * d if m is None else hp["beta_1"] * m + (1 - hp["beta_1"]) * d
        v0 = np.zeros_like(d) if v is None else v
        if name == "fedadam":
            v = hp["beta_2"] * v0 + (1 - hp["beta_2"]) * d * d
            eta = hp["eta"] * np.sqrt(1 - hp["beta_2"] ** (t + 1)) / (1 - hp["beta_1"] ** (t + 1))
        else:
            v = v0 - (1 - hp["beta_2"]) * d * d * np.sign(v0 - d * d)
            eta = hp["eta"]
        x = x + eta * m / (np.sqrt(v) + hp["tau"])
    return x


@pytest.mark.parametrize("name, given", [("fedadam", {}), ("fedyogi", {"eta": 0.05}),
                                         ("fedavgm", {"server_momentum": 0.9})])
def test_server_optimisers_follow_flowers_update_rules(name, given) -> None:
    hp = FedConfig(server_optimizer=name, **given).server_hyperparams()
    assert hp == {**fedopt.SERVER_OPTIMIZERS[name], **given}
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(5, 3))
    deltas = [rng.normal(0, 0.1, (5, 3)) for _ in range(3)]
    state, x = fedopt.ServerState(), {"w": x0}
    for t, d in enumerate(deltas, start=1):
        x = fedopt.server_step(name, hp, state, x, {"w": d}, t)
    np.testing.assert_allclose(x["w"], _flower_reference(name, hp, x0, deltas), rtol=1e-10)


def test_a_server_optimiser_drives_real_rounds(parts) -> None:
    adam = rounds(parts, server_optimizer="fedadam", eta=0.01)
    assert np.isfinite(adam["rounds"][-1]["val_loss"])
    assert adam["rounds"][-1]["val_loss"] < adam["start_val_loss"]


def test_registry_aggregators_shrug_off_a_poisoned_client_within_rounds(parts) -> None:
    clean = rounds(parts)
    poisoned = rounds(parts, poisoned_clients=1)
    median = rounds(parts, poisoned_clients=1, aggregation="median")
    krum = rounds(parts, poisoned_clients=1, aggregation="krum", num_byzantine=1,
                  num_clients=5, fraction_fit=1.0)
    loss = {k: r["rounds"][-1]["val_loss"] for k, r in
            (("clean", clean), ("poisoned", poisoned), ("median", median), ("krum", krum))}
    assert loss["poisoned"] > loss["clean"] + 0.1, loss
    assert loss["median"] < loss["poisoned"] and loss["krum"] < loss["poisoned"], loss
    assert krum["rounds"][0]["client_weights"][0] == 0.0  # the poisoned client is not chosen


def test_dp_solves_the_noise_for_a_target_epsilon_and_warns_when_it_drowns_the_update(
        parts, capsys) -> None:
    rep = rounds(parts, fraction_fit=0.5, clip_norm=0.1, target_epsilon=2.0)
    z = rep["noise_multiplier"]
    assert rep["epsilon"] == pytest.approx(2.0, rel=1e-3) and rep["epsilon"] <= 2.0
    assert dp.epsilon(0.99 * z, 0.5, 2, 1e-5) > 2.0  # the smallest noise that reaches it
    assert "the DP noise drowns the update in 2 of 2 rounds" in rep["warnings"][0]
    assert "the DP noise drowns the update" in capsys.readouterr().err
    quiet = rounds(parts, clip_norm=0.1, noise_multiplier=1e-4)
    assert quiet["warnings"] == [] and 0 < quiet["rounds"][0]["noise_norm"] < \
        quiet["rounds"][0]["update_norm"]
    with pytest.raises(ValueError, match="fedavg.aggregation must be uniform with DP"):
        FedConfig(clip_norm=1.0, noise_multiplier=1.0, aggregation="median")
    with pytest.raises(ValueError, match="target_epsilon must be set together with "
                                         "fedavg.clip_norm"):
        FedConfig(target_epsilon=1.0)
