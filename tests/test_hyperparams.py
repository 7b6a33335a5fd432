"""The local engine's optax: numbers in the state, same updates, one program for all of them."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from capibara_exp.runtime import hyperparams as lifted_optax
from capibara_exp.runtime.utils import create_learning_rate_scheduler


def params() -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    return {"dense": {"kernel": jax.random.normal(keys[0], (8, 4))},
            "bias": jax.random.normal(keys[1], (4,))}


def schedule(base: float):
    return create_learning_rate_scheduler("constant * linear_warmup * rsqrt_normalized_decay",
                                          base_learning_rate=base, warmup_steps=3)


def adamw(module, base: float, weight_decay: float):
    return optax.chain(module.clip_by_global_norm(1.0),
                       module.adamw(schedule(base), b1=0.9, b2=0.98, weight_decay=weight_decay))


def run(tx: optax.GradientTransformation, steps: int = 5) -> dict:
    p = params()
    state = tx.init(p)
    for i in range(steps):
        grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), p)
        updates, state = tx.update(grads, state, p)
        p = optax.apply_updates(p, updates)
    return p


def test_lifted_optimizer_takes_the_same_steps_as_optax() -> None:
    want = run(adamw(optax, 3e-3, 0.01))
    got = run(adamw(lifted_optax, 3e-3, 0.01))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)  # f32: constants fold differently


def lowered_step(module, base: float, weight_decay: float) -> str:
    tx = adamw(module, base, weight_decay)
    p = params()

    def step(state, p):
        updates, state = tx.update(jax.tree.map(jnp.ones_like, p), state, p)
        return optax.apply_updates(p, updates), state

    return jax.jit(step).lower(tx.init(p), p).as_text()


def test_trials_with_other_numbers_lower_to_the_same_program() -> None:
    # Plain optax bakes the numbers in: different programs, one compile per trial.
    assert lowered_step(optax, 3e-3, 0.01) != lowered_step(optax, 1e-3, 0.1)
    assert lowered_step(lifted_optax, 3e-3, 0.01) == lowered_step(lifted_optax, 1e-3, 0.1)


def test_the_checkpointed_state_is_plain_optax_and_restores_the_configured_numbers() -> None:
    p = params()
    plain, lifted = adamw(optax, 3e-3, 0.01), adamw(lifted_optax, 1e-2, 0.1)
    state = lifted.init(p)
    stripped = lifted_optax.strip(state)
    assert (jax.tree.structure(stripped) == jax.tree.structure(plain.init(p)))
    assert (serialization.to_state_dict(stripped).keys()
            == serialization.to_state_dict(plain.init(p)).keys())
    restored = lifted_optax.rejoin(state, jax.tree.map(lambda x: x + 1, stripped))
    hp = restored[1].hyperparams
    assert float(hp["weight_decay"]) == np.float32(0.1)
    assert float(hp["learning_rate"]["base_learning_rate"]) == np.float32(1e-2)
    assert int(restored[1].inner_state[0].count) == 1  # restored, not the template's


def test_every_gin_optimizer_name_is_optax_s_own_lifted() -> None:
    """What config.gin names `hyperparams.<name>` is written out in hyperparams.py (grep finds
    it) and wraps optax's function of that name, which engine=t5x uses itself."""
    import re

    from capibara_exp.base.paths import GIN_DIR

    used = {m for path in GIN_DIR.rglob("*.gin")
            for m in re.findall(r"(?<![/\w])hyperparams\.(\w+)(?=[(.:\s])", path.read_text())}
    assert "adamw" in used and "clip_by_global_norm" in used
    source = Path(lifted_optax.__file__).read_text()
    for name in used:
        assert re.search(rf"^{name} = lift\(optax\.{name}\)$", source, re.M), name
        assert getattr(lifted_optax, name).__wrapped__ is getattr(optax, name)
    assert not hasattr(lifted_optax, "softmax_cross_entropy")  # no pass-through magic
