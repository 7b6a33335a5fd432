"""capibara-exp-generate end to end from a trained checkpoint (engine=local): outputs and
their record, each decoding method, resume after a stop, and one-line refusals that write
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capibara_exp.base.errors import PREEMPTED_EXIT_CODE
from capibara_exp.cli import generate as generate_cli
from tests.test_train import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, data_dir) -> Path:
    path = tmp_path_factory.mktemp("gen") / "run"
    train(path, "trainer.train_steps=2", "trainer.eval_period=2", "checkpoint.checkpoint_period=2")
    return path


def generate(capsys, *args: str) -> tuple[int, str]:
    try:
        generate_cli.main(list(args))
        code = 0
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, (out.out + out.err).strip().splitlines()[-1]


def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def add(a, b):", "id": "x"}\n\n{"inputs": "SELECT"}\n'
                    '{"text": "print(1)"}\n')
    return path


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_generates_from_a_trained_run(capsys, tmp_path: Path, run_dir: Path, method: str) -> None:
    out = tmp_path / "out.jsonl"
    extra = {"sample": ["num_samples=2", "top_k=20", "temperature=0.9"],
             "beam": ["num_beams=3", "num_samples=2"], "greedy": []}[method]
    code, line = generate(capsys, f"checkpoint={run_dir}", f"prompts={prompts_file(tmp_path)}",
                          f"out={out}", f"method={method}", "max_new_tokens=5", "batch_size=2",
                          *extra)
    assert code == 0, line
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def add(a, b):", "SELECT", "print(1)"]
    assert rows[0]["id"] == "x"
    for r in rows:
        assert len(r["outputs"]) == (1 if method == "greedy" else 2)
        assert all(len(o["ids"]) <= 5 and isinstance(o["text"], str) for o in r["outputs"])
    record = json.loads((tmp_path / "out.jsonl.record.json").read_text())
    assert record["checkpoint"] == str(run_dir / "checkpoint_2")
    assert record["sampling"]["method"] == method and record["status"] == "finished"
    assert record["model"]["emb_dim"] == 32 and record["count"] == 3


def test_a_stop_text_ends_each_output_at_its_tokens(capsys, tmp_path: Path,
                                                   run_dir: Path) -> None:
    """stop_text is encoded in the model's vocabulary (bytes here: several tokens) and each
    output ends before its first occurrence, as cutting the full output there does."""
    common = [f"checkpoint={run_dir}", f"prompts={prompts_file(tmp_path)}", "max_new_tokens=12"]
    code, line = generate(capsys, *common, f"out={tmp_path / 'full.jsonl'}")
    assert code == 0, line
    full = [json.loads(r)["outputs"][0]["ids"] for r in
            (tmp_path / "full.jsonl").read_text().splitlines()]
    printable = [(a, b) for ids in full for a, b in zip(ids, ids[1:], strict=False)
                 if all(35 <= x <= 129 and x != 95 for x in (a, b))]  # printable, not \\
    assert printable, f"{full}: no two printable bytes to stop at"
    pair = printable[0]
    stop = bytes(t - 3 for t in pair).decode()
    code, line = generate(capsys, *common, f"out={tmp_path / 'stopped.jsonl'}",
                          f"stop_text={stop}")
    assert code == 0, line
    got = [json.loads(r)["outputs"][0]["ids"] for r in
           (tmp_path / "stopped.jsonl").read_text().splitlines()]

    def cut(ids):  # the reference: the full output before the pair's first occurrence
        at = next((i for i in range(len(ids) - 1) if tuple(ids[i:i + 2]) == pair), None)
        return ids if at is None else ids[:at]

    assert got == [cut(ids) for ids in full]
    assert any(len(g) < len(f) for g, f in zip(got, full, strict=True))


def test_a_stopped_run_resumes_after_its_finished_prompts(capsys, tmp_path: Path,
                                                          run_dir: Path, monkeypatch) -> None:
    from capibara_exp.generation import command

    prompts = prompts_file(tmp_path)
    args = [f"checkpoint={run_dir}", f"prompts={prompts}", f"out={tmp_path / 'o.jsonl'}",
            "max_new_tokens=4", "batch_size=1"]
    real = command._stop_on_signal
    monkeypatch.setattr(command, "_stop_on_signal", lambda: {"signal": "SIGTERM"})
    code, line = generate(capsys, *args)
    assert code == PREEMPTED_EXIT_CODE and "after 1 of 3" in line
    kept = (tmp_path / "o.jsonl").read_text().splitlines()
    assert len(kept) == 1
    monkeypatch.setattr(command, "_stop_on_signal", real)
    code, line = generate(capsys, *args)
    assert code == 0, line
    done = (tmp_path / "o.jsonl").read_text().splitlines()
    assert done[0] == kept[0] and len(done) == 3
    code, _ = generate(capsys, f"checkpoint={run_dir}", f"prompts={prompts}",
                       f"out={tmp_path / 'fresh.jsonl'}", "max_new_tokens=4", "batch_size=1")
    assert (tmp_path / "fresh.jsonl").read_text().splitlines() == done  # greedy: the same


@pytest.mark.parametrize("case, message", [
    ("empty", "no prompts in it (empty file)"),
    ("long", "needs a cache of"),
    ("mismatch", "does not fit the model"),
    ("missing", "no checkpoint_<step>"),
    ("exists", "exists"),
    ("bad_json", ":2: not JSON"),
    ("method", "method='best'"),
    ("both", "one of them"),
])
def test_refusals_are_one_line_and_write_nothing(capsys, tmp_path: Path, run_dir: Path,
                                                 case: str, message: str) -> None:
    out = tmp_path / "out.jsonl"
    good = prompts_file(tmp_path)
    args = {"checkpoint": str(run_dir), "prompts": str(good), "out": str(out)}
    if case == "empty":
        (tmp_path / "e.txt").write_text("\n\n")
        args["prompts"] = str(tmp_path / "e.txt")
    elif case == "long":
        args["max_length"] = "20"
    elif case == "mismatch":
        args["model"] = "llama3_tiny"
    elif case == "missing":
        args["checkpoint"] = str(tmp_path)
    elif case == "exists":
        out.write_text("keep\n")
    elif case == "bad_json":
        (tmp_path / "b.jsonl").write_text('{"prompt": "a"}\n{nope\n')
        args["prompts"] = str(tmp_path / "b.jsonl")
    elif case == "method":
        args["method"] = "best"
    elif case == "both":
        args["task"] = "capibara_bytes_lm"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, line = generate(capsys, *(f"{k}={v}" for k, v in args.items()))
    assert code == 2 and message in line and line.startswith("capibara-exp-generate: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "exists":
        assert out.read_text() == "keep\n"
