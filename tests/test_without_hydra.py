"""checks.without_hydra: the composed config without its `hydra` node, a copy of its own
(the checks bind model_dir in it), keeping the root's flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError

from capibara_exp.cli import checks
from capibara_exp.cli import compose as composing
from capibara_exp.composing.resolvers import register_resolvers


def test_it_is_the_config_but_hydra_its_own_copy_with_its_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    register_resolvers()
    monkeypatch.chdir(tmp_path)
    cfg = composing.compose("config", ["experiment=dense_small_rope"], []).cfg
    before = OmegaConf.to_yaml(cfg)
    plain = checks.without_hydra(cfg)
    assert "hydra" not in plain and list(plain) == [k for k in cfg if k != "hydra"]
    whole = cfg.copy()  # the plain way: all of it copied, then hydra removed
    with open_dict(whole):
        del whole["hydra"]
    assert OmegaConf.to_container(plain, resolve=True) == OmegaConf.to_container(
        whole, resolve=True)
    assert OmegaConf.is_struct(plain)
    with pytest.raises(ConfigAttributeError):
        plain.model.emb_dm = 3  # a key typo is refused, as in the composed config
    plain.model.emb_dim = 3
    checks._bind_model_dir(plain, "/elsewhere")
    assert OmegaConf.to_yaml(cfg) == before  # the composed config is untouched
    assert plain.model_dir == "/elsewhere" and plain.model.emb_dim == 3
    OmegaConf.set_readonly(cfg, True)
    assert OmegaConf.is_readonly(checks.without_hydra(cfg))
