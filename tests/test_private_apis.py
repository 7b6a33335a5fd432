"""Private names of other libraries: the ones capibara_exp.base.private_apis lists must exist in
the installed libraries, and no other module may use any."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import logging
import sys
from pathlib import Path

import pytest

from capibara_exp.base import private_apis

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("capibara_exp", "hydra_plugins", "bench")
# namedtuple's public API is spelled with a leading underscore
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# ...and os._exit (exit without cleanup handlers) is the standard library's documented API
STDLIB_API = {"_exit"}


def _resolve(use: private_apis.PrivateUse) -> object:
    obj = importlib.import_module(use.module)
    for part in use.name.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("use", private_apis.USES, ids=lambda u: f"{u.module}.{u.name}")
def test_every_listed_private_name_is_in_the_installed_library(
        use: private_apis.PrivateUse) -> None:
    top = use.module.split(".")[0]
    dist = importlib.metadata.packages_distributions().get(top, [top])[0]
    version = importlib.metadata.version(dist)
    try:
        found = _resolve(use)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"PRIVATE API GONE: {use.module}.{use.name} is not in the installed {dist} "
                    f"{version} ({err}). capibara_exp/base/private_apis.py uses it for {use.why} "
                    "Find the library's public way, or its new private name, and update "
                    "base/private_apis.py.")
    assert callable(found), f"{use.module}.{use.name} in {dist} {version} is no longer callable"


def test_the_stale_trial_query_still_takes_a_study_id() -> None:
    stale_ids = _resolve(next(u for u in private_apis.USES
                              if u.name.endswith("._get_stale_trial_ids")))
    params = list(inspect.signature(stale_ids).parameters)
    assert params == ["self", "study_id"], (
        f"optuna.storages.RDBStorage._get_stale_trial_ids takes {params} in optuna "
        f"{importlib.metadata.version('optuna')}, not (self, study_id): "
        "update base/private_apis.py")


def test_jax_keeps_its_coordination_client_where_distributed_client_reads_it() -> None:
    from jax._src import distributed

    assert hasattr(distributed.global_state, "client"), (
        "jax._src.distributed.global_state.client is gone in jax "
        f"{importlib.metadata.version('jax')}: update private_apis.distributed_client")
    assert private_apis.distributed_client() is None  # nothing joined in this process
    from jax._src.lib import _jax  # the module private_apis.USES names, as JAX imports it

    for name, needs in (("key_value_try_get", "key: str"),
                        ("key_value_set", "allow_overwrite: bool"),
                        ("blocking_key_value_get", "timeout_in_ms: int")):
        doc = getattr(_jax.DistributedRuntimeClient, name).__doc__ or ""
        assert needs in doc, (f"DistributedRuntimeClient.{name} changed: "
                              f"{doc.splitlines()[:1]}; update launch/peers.py")


def _private_uses(path: Path) -> list[str]:
    """`obj._name` and imports of `_module`s or `_name`s from other packages in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and _private(node.attr) \
                and node.attr not in NAMEDTUPLE_API | STDLIB_API and not _own(node.value):
            found.append(f"{where} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(
                "capibara_exp"):
            names = [*(node.module or "").split("."), *(a.name for a in node.names)]
            found += [f"{where} from {node.module} import {n}" for n in names if _private(n)]
        elif isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if any(_private(part) for part in a.name.split("."))]
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(value: ast.expr) -> bool:
    """self._x, cls._x, super()._x: a class's own members."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "super")


def test_no_module_but_private_apis_uses_a_private_name_of_another_library() -> None:
    allowed = ROOT / "capibara_exp" / "base/private_apis.py"
    found = [use for folder in SOURCES for path in sorted((ROOT / folder).rglob("*.py"))
             if path != allowed for use in _private_uses(path)]
    assert not found, ("private names used outside capibara_exp/base/private_apis.py (call them "
                       "from there, with the reason): " + "; ".join(found))
    assert _private_uses(allowed), "the scan finds nothing even where it should"


def test_the_sweeper_composes_each_trial_once_under_hydras_basic_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeper tells Hydra's in-process launcher by its public config option
    (hydra/launcher=basic): under it each trial's job runs in this process, and the sweeper
    does not compose the job's config a second time to check it first."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.plugins.sweeper import Sweeper

    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.cli.common import register_resolvers, register_sweeper

    ran: list[float] = []
    checks: list = []
    monkeypatch.setattr(Sweeper, "validate_batch_is_legal",
                        lambda self, batch: checks.append(batch))

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def task(cfg) -> dict:
        ran.append(float(cfg.sweep_x))  # this process's list: the job ran here
        return {"loss": (cfg.sweep_x - 0.3) ** 2}

    register_resolvers()
    register_sweeper()
    monkeypatch.setattr(sys, "argv", [
        "test", "-m", "hydra/sweeper=capibara_optuna", "hydra/launcher=basic",
        "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler=random",
        f"hydra.sweep.dir={tmp_path}", "+sweep_x=interval(0, 1)"])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        task()
    finally:  # Hydra configured this process's logging for its jobs: undo it
        GlobalHydra.instance().clear()
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    assert len(ran) == 2 and all(0 <= x <= 1 for x in ran)
    assert checks == []  # composed once, by the launcher
