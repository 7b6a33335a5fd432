"""The splash kernel's block size and fused backward as model options and as the planner's
search dimensions (nets/splash.py, tuning/mesh_space.py)."""

from __future__ import annotations

import pytest

from capibara_exp.tuning import mesh_space


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
def test_smaller_blocks_and_the_fused_backward_match_dot_attention(fused):
    """Blocks of 128 over 256 positions (two per sequence), with and without the fused
    dq/dkv backward kernel (the Pallas interpreter on CPU): values and the gradients of q,
    k and v equal dot attention's on every real position."""
    from tests.test_nets import assert_splash_matches_dot

    assert_splash_matches_dot(1, True, block=128, fused_bwd=fused)


def test_block_sizes_are_checked_where_they_are_set():
    from capibara_exp.base.errors import ConfigError
    from capibara_exp.nets import DecoderConfig
    from capibara_exp.tuning import plan
    from tests.conftest import compose_config

    with pytest.raises(ValueError, match=r"splash_block must be a multiple of 128 \(the "
                                         r"kernel.s tiles\), got 100"):
        DecoderConfig(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, num_layers=1,
                      mlp_dim=64, splash_block=100)
    rope = ["+tune_mesh=default", "model.position_embedding=rope",
            "data.task_feature_lengths={targets: 2048}"]
    assert plan.splash_choices(compose_config(rope)) == {"splash_blocks": [512],
                                                         "splash_fused_bwd": [False]}
    chosen = compose_config([*rope, "tune_mesh.splash_blocks=[512,2048]",
                             "tune_mesh.splash_fused_bwd=[false,true]"])
    assert plan.splash_choices(chosen)["splash_blocks"] == [512, 2048]
    with pytest.raises(ConfigError, match="tune_mesh.splash_blocks: 1536"):
        plan.splash_choices(compose_config([*rope, "tune_mesh.splash_blocks=[1536]"]))


def test_splash_candidates_try_each_block_and_backward_dot_ones_do_not():
    cands = mesh_space.candidates(4, 4, None, 8, attentions=["dot", "splash"],
                             splash_blocks=[512, 2048], splash_fused_bwd=[False, True])
    per_mesh = [c for c in cands if c.mesh == "4x1x1"]
    assert sorted((c.attention, c.splash_block, c.splash_fused_bwd) for c in per_mesh) == [
        ("dot", 512, False), ("splash", 512, False), ("splash", 512, True),
        ("splash", 2048, False), ("splash", 2048, True)]
    fused = next(c for c in per_mesh if c.splash_fused_bwd and c.splash_block == 2048)
    assert "block=2048 fused" in fused.key
    assert {"model.splash_block=2048", "model.splash_fused_bwd=true"} <= set(
        fused.overrides(moe=False))
