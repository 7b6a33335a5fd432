"""Processing, playbooks, routing splits, the build and its manifest, SeqIO tasks and mixtures."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from capibara_exp.base.paths import GIN_DIR
from capibara_exp.composing import gin_bridge
from capibara_exp.data import routing
from capibara_exp.data.e2b import build, collector, playbooks, processing, sandbox, snippets
from capibara_exp.data.e2b.quarantine import Quarantine
from capibara_exp.data.e2b.records import ExecutionRecord, parse_records, write_records
from tests.conftest import compose_config

# Real JavaScript for the javascript domain: node runs it in the sandbox like any snippet.
_JS = [
    "[3, 1, 2].sort((a, b) => a - b)",
    "'a-b-c'.split('-').map(s => s.toUpperCase()).join('')",
    "const m = new Map([[1, 'one']]);\nm.get(1)",
    "Array.from({length: 4}, (_, i) => i * i)",
    "Object.entries({x: 1, y: 2}).length",
    "class P { constructor(x) { this.x = x } }\nnew P(2).x",
    "null.f",
    "undefinedFunction()",
]


def _pick(items: list[snippets.Snippet], pred, n: int) -> list[snippets.Snippet]:
    return [s for s in items if pred(s)][:n]


@pytest.fixture(scope="module")
def log_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real execution log: chosen stdlib doctests, sqlite3 SQL and JS, run in the sandbox."""
    stdlib = list(snippets.stdlib_doctests())
    chosen = (
        _pick(stdlib, lambda s: s.module == "difflib", 8)
        + _pick(stdlib, lambda s: s.module == "statistics", 8)
        + _pick(stdlib, lambda s: bool(routing._API.match(s.module)), 8)
        + list(snippets.sqlite_statements())[:12]
    )
    if sandbox.node_binary():
        chosen += [
            snippets.Snippet(f"test-js:{i}", "javascript", c, "test-js") for i, c in enumerate(_JS)
        ]
    records = collector.collect_local(chosen, sandbox.Limits())
    path = tmp_path_factory.mktemp("logs") / "e2b.jsonl"
    write_records(path, records)
    with open(path, "a", encoding="utf-8") as f:  # one duplicate and two bad lines
        f.write(
            path.read_text().splitlines()[0] + "\n" + '{"id": "x", "language": "python"\n' + "[1]\n"
        )
    return path


def _cfg(log_file: Path, **overrides) -> dict:
    return build.build_config(
        {"collect": {"sources": []}, "inputs": {"logs": [str(log_file)]}, **overrides}
    )


@pytest.fixture(scope="module")
def built(log_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, build.ensure_built(data_dir, _cfg(log_file))


def test_manifest_has_counts_hashes_filters_and_quarantine(
    built: tuple[Path, dict], log_file: Path
) -> None:
    data_dir, manifest = built
    assert manifest["quarantine"]["logs"] == {"truncated_json": 1, "wrong_type": 1}
    assert manifest["processing"]["dropped_by_filter"]["dedup"] >= 1
    assert manifest["config"]["filters"] == build.default_config()["filters"]
    scrubbing = manifest["secret_scrubbing"]
    gen, lofo = scrubbing["generated"], scrubbing["leave_one_family_out"]
    fmt = scrubbing["provider_formats"]
    assert gen["recall"] >= 0.99 and min(gen["recall_per_class"].values()) >= 0.99, gen
    assert lofo["families"] >= 20 and lofo["worst_recall"] >= 0.99, lofo
    assert fmt["formats"] >= 25 and fmt["min_recall"] >= 0.99, fmt
    assert fmt["negatives"] >= 300 and fmt["negatives_altered_share"] <= 0.02
    assert gen["negatives"] >= 1000 and gen["negatives_altered_share"] <= 0.02
    assert manifest["secrets_found_at_rest"] == {}  # the last pass found nothing left
    (name, counts), = manifest["inputs"].items()  # per input file, as the summary prints
    assert name == str(log_file) and counts["quarantined"] == 2 and counts["deduplicated"] >= 1
    assert counts["accepted"] == counts["examples"] + counts["deduplicated"] + counts["filtered"]
    assert manifest["warnings"] == [] and manifest["routing"]["left_out"] == {}
    assert set(manifest["playbooks"]["per_domain"]) == set(routing.DOMAINS)
    out = build.dataset_dir(data_dir)
    on_disk = {
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.name != "manifest.json"
    }
    assert set(manifest["files"]) == on_disk  # every file the build wrote, and only those
    folders = {name.split("/")[0] for name in on_disk}
    assert folders == {"examples", "playbooks", "quarantine", "routing", "sources"}
    for name, sha in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == sha, name
    per = manifest["routing"]["per_domain_split"]
    assert all(per.get(f"{d}/{s}", 0) > 0 for d in routing.DOMAINS for s in routing.SPLITS), per
    q = (out / "quarantine" / "logs.quarantine.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["reason"] for line in q) == ["truncated_json", "wrong_type"]


def test_build_is_deterministic_and_reused(
    built: tuple[Path, dict], log_file: Path, tmp_path: Path
) -> None:
    _, first = built
    stale = build.dataset_dir(tmp_path) / "logs" / "collected.jsonl"  # an earlier build's
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n")
    again = build.build(tmp_path, _cfg(log_file))
    assert again["files"] == first["files"] and not stale.exists()
    assert build.ensure_built(built[0]) == first  # a run with no config reuses any build


def test_split_is_a_function_of_the_id_alone() -> None:
    ids = [f"example-{i}" for i in range(2000)]
    splits = [routing.split_of(i, 10, 10) for i in ids]
    assert [routing.split_of(i, 10, 10) for i in reversed(ids)] == splits[::-1]
    share = {s: splits.count(s) / len(ids) for s in routing.SPLITS}
    assert 0.75 < share["train"] < 0.85 and 0.07 < share["test"] < 0.13, share


def test_zero_examples_names_the_filters(log_file: Path, tmp_path: Path) -> None:
    cfg = _cfg(log_file, filters={"min_quality": 1.5})
    with pytest.raises(processing.NoExamplesError, match=r"min_quality=1.5 dropped \d+"):
        build.build(tmp_path, cfg)


def test_when_every_line_is_bad_the_quarantine_is_written_and_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "language": "python"\n[1]\nnot json\n')
    with pytest.raises(
        build.BuildError,
        match=r"inputs.logs\[0\]: .*bad.jsonl: no record accepted, 3 line\(s\) quarantined "
        r"\(top reasons: truncated_json 1, wrong_type 1, invalid_json 1\); see .*logs.quarantine",
    ):
        build.build(tmp_path / "data", _cfg(bad))
    q = build.dataset_dir(tmp_path / "data") / "quarantine" / "logs.quarantine.jsonl"
    assert [json.loads(line)["line"] for line in q.read_text().splitlines()] == [1, 2, 3]
    assert not (build.dataset_dir(tmp_path / "data") / "manifest.json").exists()


def test_a_missing_input_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(build.BuildError, match=r"inputs.logs\[0\]: /no/such.jsonl is not a file"):
        build.build(tmp_path, _cfg(Path("/no/such.jsonl")))


def test_dedup_keys_on_code_and_outcome_by_default_or_as_configured(log_file: Path) -> None:
    import copy

    twin = next(parse_records(log_file, Quarantine()))
    twin2 = ExecutionRecord(
        **{**twin.__dict__, "id": "twin", "code": "  " + twin.code.replace("\n", "  # note\n")}
    )
    rerun = copy.deepcopy(twin2)  # the same code run again, with another outcome
    rerun.id = "rerun"
    rerun.execution.logs.stdout = ["something else\n"]
    q = Quarantine()
    examples, stats = processing.process([twin, twin2, rerun], processing.Filters(), q)
    assert [e["id"] for e in examples] == [twin.id, "rerun"] and not q.entries
    assert stats["dropped_by_filter"] == {"dedup": 1}
    on_code = processing.Filters.from_dict({"dedup": ["code"]})
    assert [e["id"] for e in processing.process([twin, twin2, rerun], on_code, q)[0]] == [twin.id]
    keep_all = processing.Filters.from_dict({"dedup": []})
    assert len(processing.process([twin, twin2, rerun], keep_all, q)[0]) == 3
    with pytest.raises(ValueError, match=r"filters.dedup must be a list of fields from \["):
        processing.Filters.from_dict({"dedup": True})


def test_playbooks_consolidate_filter_top_k_and_quarantine(
    built: tuple[Path, dict], tmp_path: Path
) -> None:
    out = build.dataset_dir(built[0])
    derived = playbooks.parse(out / "playbooks" / "derived.jsonl", Quarantine(), 1 << 20)
    assert derived and all(playbooks.validate(p) is None for p in derived)
    extra = dict(derived[0], interactions=3, graduation_score=0.0)  # the same agent again: merged
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(dict(derived[0], domain="cooking"))
        + "\n"
        + json.dumps({k: v for k, v in derived[0].items() if k != "entries"})
        + "\n"
    )
    q = Quarantine()
    assert playbooks.parse(bad, q, 1 << 20) == [] and q.summary() == {
        "missing_field": 1,
        "wrong_type": 1,
    }
    kept, stats = playbooks.consolidate(
        derived + [extra], playbooks.PlaybookFilters(top_k_per_domain=1)
    )
    assert len({p["domain"] for p in kept}) == len(kept)  # at most one per domain
    assert stats["agents"] == len(derived)  # the extra playbook merged into its agent
    for domain in {p["domain"] for p in kept}:
        best = max(
            (
                p
                for p in derived
                if p["domain"] == domain and p["agent_id"] != derived[0]["agent_id"]
            ),
            key=lambda p: p["graduation_score"],
            default=None,
        )
        got = next(p for p in kept if p["domain"] == domain)
        if best is not None:
            assert got["graduation_score"] >= best["graduation_score"]


def _playbook(**changes) -> dict:
    entry = {"id": "e0", "section": "strategies", "content": "x", "helpful": 2, "harmful": 0}
    pb = {
        "agent_id": "python/a",
        "domain": "python",
        "graduation_score": 0.5,
        "interactions": 4,
        "success_rate": 0.75,
        "domain_expertise": {"python": 1.0},
        "entries": [entry],
    }
    return {**pb, **changes}


@pytest.mark.parametrize(
    "changes, reason, detail",
    [
        ({"interactions": 0}, "out_of_range", "interactions must be >= 1"),
        ({"success_rate": 7.0}, "out_of_range", "success_rate must be in [0.0, 1.0]"),
        ({"graduation_score": -3}, "out_of_range", "graduation_score must be in [0.0, 1.0]"),
        ({"graduation_score": float("inf")}, "invalid_json", "Infinity is not JSON"),
        ({"domain_expertise": {"sql": "most"}}, "wrong_type", "domain_expertise['sql']"),
        ({"entries": [{"content": "x", "helpful": "lots"}]}, "wrong_type", "helpful must be int"),
        ({"entries": [{"content": "x", "harmful": -1}]}, "out_of_range", "harmful must be >= 0"),
        ({"interactions": True}, "wrong_type", "interactions must be int"),
    ],
)
def test_a_bad_playbook_is_quarantined_with_its_reason(
    changes: dict, reason: str, detail: str, tmp_path: Path
) -> None:
    path = tmp_path / "pb.jsonl"
    path.write_text(json.dumps(_playbook()) + "\n" + json.dumps(_playbook(**changes)) + "\n")
    q = Quarantine()
    assert playbooks.parse(path, q, 1 << 20) == [_playbook()]
    assert q.summary() == {reason: 1} and detail in q.entries[0]["detail"], q.entries


def test_playbooks_of_one_agent_with_no_interactions_do_not_stop_the_build(tmp_path: Path) -> None:
    path = tmp_path / "pb.jsonl"
    path.write_text(2 * (json.dumps(_playbook(interactions=0)) + "\n"))
    q = Quarantine()
    assert playbooks.parse(path, q, 1 << 20) == [] and q.summary() == {"out_of_range": 2}
    # unvalidated input reaching the merge: equal weights, not a division by zero
    kept, _ = playbooks.consolidate(
        [_playbook(interactions=0, success_rate=0.2), _playbook(interactions=0, success_rate=0.6)],
        playbooks.PlaybookFilters(min_interactions=0),
    )
    assert kept[0]["success_rate"] == 0.4


@pytest.fixture(scope="module")
def tasks(built: tuple[Path, dict]):
    os.environ["CAPIBARA_DATA_DIR"] = str(built[0])
    from capibara_exp.data import routing_tasks

    return routing_tasks


def test_a_task_never_builds_and_names_the_command_when_nothing_is_built(
        tasks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import seqio

    from capibara_exp.data.e2b import built

    monkeypatch.setenv("CAPIBARA_DATA_DIR", str(tmp_path))
    with pytest.raises(built.NotBuilt) as caught:
        next(seqio.get_mixture_or_task(tasks.domain_task("sql")).get_dataset(
            {"targets": 128}, split="validation", shuffle=False, num_epochs=1,
            use_cached=False).as_numpy_iterator())
    message = str(caught.value)
    assert "\n" not in message and f"capibara-exp-data data_dir={tmp_path}" in message
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing made


def test_each_domain_task_yields_its_domain(tasks) -> None:
    import seqio

    for domain in routing.DOMAINS:
        ds = seqio.get_mixture_or_task(tasks.domain_task(domain)).get_dataset(
            {"targets": 128}, split="validation", shuffle=False, num_epochs=1, use_cached=False
        )
        ex = next(ds.as_numpy_iterator())
        assert ex["domain"].decode() == domain and ex["difficulty"].decode() in routing.DIFFICULTIES
        assert ex["targets"].dtype == np.int32 and 0 < ex["targets"].size <= 128


@pytest.mark.slow
def test_mixture_gives_packed_batches_and_next_fit_is_seqio(tasks) -> None:
    import seqio

    from capibara_exp.data import packing
    from capibara_exp.runtime import inputs
    from capibara_exp.runtime.utils import DatasetConfig

    cfg = DatasetConfig(
        mixture_or_task_name="capibara_e2b_routing",
        task_feature_lengths={"targets": 64},
        split="train",
        batch_size=4,
        shuffle=True,
        seed=7,
        pack=True,
        module="capibara_exp.data.routing_tasks",
    )

    def take(strategy: str, n: int = 12) -> list[dict]:
        it = inputs.batches(cfg, seqio.DecoderFeatureConverter, 7, packer=packing.Packer(strategy))
        return [next(it) for _ in range(n)]

    ours, theirs, first = take("next_fit"), take("seqio"), take("first_fit")
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    fill = lambda bs: np.mean([(b["decoder_segment_ids"] > 0).mean() for b in bs])  # noqa: E731
    assert first[0]["decoder_target_tokens"].shape == (4, 64)
    assert fill(first) >= fill(theirs)


def test_mixture_rates_from_conf_and_overrides(tasks) -> None:
    import seqio

    mix = seqio.get_mixture_or_task("capibara_e2b_routing")
    assert {t.name for t in mix.tasks} == {tasks.domain_task(d) for d in routing.DOMAINS}
    shipped = {
        d: mix.get_rate(seqio.get_mixture_or_task(tasks.domain_task(d))) for d in routing.DOMAINS
    }
    assert tasks.mixture_with_rates("capibara_e2b_routing", shipped) == "capibara_e2b_routing"
    variant = tasks.mixture_with_rates("capibara_e2b_routing", {**shipped, "sql": 3.0})
    assert variant != "capibara_e2b_routing"
    assert (
        seqio.get_mixture_or_task(variant).get_rate(
            seqio.get_mixture_or_task(tasks.domain_task("sql"))
        )
        == 3.0
    )
    with pytest.raises(ValueError, match="unknown key.*cooking"):
        tasks.mixture_with_rates("capibara_e2b_routing", {"cooking": 1.0})


def test_routing_gin_binds_the_mixture_and_packer(tasks, tmp_path: Path) -> None:
    import gin
    from capibara_exp.data import packing
    from capibara_exp.runtime import gin_utils

    cfg = compose_config(
        ["data=e2b_routing", "data.mixture_rates.sql=2.0", "data.packing=next_fit"]
    )
    gin_utils.parse(tmp_path / "config.gin", gin_bridge.render(cfg, "local", GIN_DIR))
    name = gin.get_configurable(tasks.mixture_with_rates)()
    assert name.startswith("capibara_e2b_routing_")  # the overridden rate made a variant
    from capibara_exp.runtime import utils

    with gin.config_scope("train"):
        assert gin.get_configurable(utils.DatasetConfig)().packer == packing.Packer("next_fit")
    t5x = gin_bridge.render(cfg, "t5x", GIN_DIR)
    assert (
        gin_bridge.render(cfg, "local", GIN_DIR).split(gin_bridge.BODY_MARKER)[1]
        == t5x.split(gin_bridge.BODY_MARKER)[1]
    )


def test_packer_setting_is_checked() -> None:
    from capibara_exp.data import packing

    with pytest.raises(ValueError, match=r"data_packing.packer.strategy: 'best_fit' is not one of"):
        packing.packer("best_fit")


@pytest.mark.entry
def test_capibara_exp_data_builds_with_overrides(log_file: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    args = [
        sys.executable,
        "-c",
        "from capibara_exp.cli.data import main; main()",
        f"data_dir={tmp_path}",
        "collect.sources=[]",
        f"inputs.logs=[{log_file}]",
        "playbooks.top_k_per_domain=2",
    ]
    done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((build.dataset_dir(tmp_path) / "manifest.json").read_text())
    assert manifest["config"]["playbooks"]["top_k_per_domain"] == 2
    assert all(v["playbooks"] <= 2 for v in manifest["playbooks"]["per_domain"].values())
    bad = subprocess.run(
        args[:3]
        + [
            f"data_dir={tmp_path}",
            "force=true",
            "collect.sources=[]",
            f"inputs.logs=[{log_file}]",
            "filters.min_quality=2.0",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert bad.returncode == 2 and "min_quality=2.0 dropped" in bad.stderr
    missing = subprocess.run(
        args[:3] + [f"data_dir={tmp_path}", "inputs.logs=[/no/such.jsonl]"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "capibara-exp-data: configuration error: inputs.logs[0]=/no/such.jsonl: no such file "
        "or directory"
    ]
    built_names = sorted(p.name for p in build.dataset_dir(tmp_path).iterdir())
    assert built_names == [  # no Hydra run dir or log file, no lock once the build ended
        "examples",
        "playbooks",
        "quarantine",
        "routing",
        "sources",
    ]
    helped = subprocess.run(args[:3] + ["--help"], capture_output=True, text=True, check=True)
    assert "capibara-exp-data: build the E2B" in helped.stdout and "min_quality" in helped.stdout
    assert "model:" not in helped.stdout and "optimizer:" not in helped.stdout


def test_dropping_the_batch_iterator_stops_its_producer(tasks) -> None:
    import threading
    import time

    import seqio

    from capibara_exp.runtime import inputs
    from capibara_exp.runtime.utils import DatasetConfig

    cfg = DatasetConfig(
        mixture_or_task_name=tasks.domain_task("ml"),
        task_feature_lengths={"targets": 64},
        split="train",
        batch_size=2,
        shuffle=False,
        seed=0,
        pack=True,
    )
    it = inputs.batches(cfg, seqio.DecoderFeatureConverter, 0)
    assert next(it)["decoder_target_tokens"].shape == (2, 64)
    assert any(t.name == "capibara-input" for t in threading.enumerate())
    it.close()
    deadline = time.monotonic() + 10
    while (
        any(t.name == "capibara-input" for t in threading.enumerate())
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not any(t.name == "capibara-input" for t in threading.enumerate())


def test_a_run_builds_the_e2b_data_first_when_a_task_it_reads_needs_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from capibara_exp import experiment
    from tests.conftest import compose_config

    monkeypatch.delenv("CAPIBARA_CODEGEN_LOGS", raising=False)
    reads = {o: experiment.reads_e2b_data(compose_config([o] if o else []))
             for o in ("", "data=e2b_routing", "curriculum=easy_to_hard", "infer_eval=codegen")}
    assert reads == {"": False, "data=e2b_routing": True, "curriculum=easy_to_hard": True,
                     "infer_eval=codegen": True}
    monkeypatch.setenv("CAPIBARA_CODEGEN_LOGS", "logs.jsonl")  # its own logs: no build
    assert not experiment.reads_e2b_data(compose_config(["infer_eval=codegen"]))
