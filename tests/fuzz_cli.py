"""A property-based fuzzer over every console script's arguments: Hydra's override grammar
(keys the configs have and keys they do not, the +/++/~ prefixes, every kind of value the
grammar parses: numbers huge and tiny, nan, quoted and unbalanced strings, lists, dicts,
interpolations, sweep functions), Hydra's and T5X's flags, and paths of every kind (empty,
a file, an input run dir, missing parents, over-long names, /proc, /dev/full).

The property, for each generated command line run through the script's own `main` in
this process: the exit status is 0, 1, 2 or 75; nothing prints a traceback or an internal
error (exit 1 is for the environment only: a full device, a path it cannot reach); a
refusal (2) is one line on stderr and leaves the sandbox (inputs, cwd) exactly as it was (hashes
and mtimes). What comes after the checks is the library's work, not the argument
handling: there the script's job (Hydra's task function, or the library call of the
scripts without Hydra) is replaced by `Accepted`, an exit 0.

    python -m bench.fuzz_cli --examples 3000      # the torture mode: figures per script
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from hypothesis import strategies as st

from capibara_exp.composing import config_schema
from tests.console_lines import error_lines
from tests.snapshots import snapshot

SAFE_CODES = {0, 1, 2, 75}


class Accepted(SystemExit):
    """The command passed every check and reached the work it asks for."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(0)


# script -> (module, [(module, attribute) the job is]); the job is replaced by Accepted
SCRIPTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "capibara-exp": ("capibara_exp.cli.main", [("capibara_exp.cli.main", "_app")]),
    "capibara-exp-merge": ("capibara_exp.cli.merge", [("capibara_exp.cli.merge", "_app")]),
    "capibara-exp-data": ("capibara_exp.cli.data", [("capibara_exp.cli.data", "_app")]),
    "capibara-exp-tune-mesh": ("capibara_exp.cli.tune_mesh",
                               [("capibara_exp.cli.tune_mesh", "_app")]),
    "capibara-exp-plot": ("capibara_exp.cli.plot", [("capibara_exp.cli.run_curves", "render")]),
    "capibara-exp-convert": ("capibara_exp.cli.convert", [("capibara_exp.cli.convert", "run")]),
    "capibara-exp-lora": ("capibara_exp.cli.lora",
                          [("capibara_exp.runtime.lora.export", "export_run")]),
    # (its Hydra app too, as the others': run here, Hydra's --hydra-help configures logging
    # with dictConfig, which closes every live handler of this process, pytest's included)
    "capibara-exp-meta": ("capibara_exp.cli.meta",
                          [("capibara_exp.consensus.meta_consensus", "run"),
                           ("capibara_exp.cli.meta", "_app")]),
    "capibara-exp-generate": ("capibara_exp.cli.generate",
                              [("capibara_exp.generation.command", "run")]),
}


def make_sandbox() -> Path:
    """A fresh tree of inputs the generated paths point into, and a cwd."""
    root = Path(tempfile.mkdtemp(prefix="capibara-fuzz-"))
    run = root / "run"
    (run / "checkpoint_4").mkdir(parents=True)
    (run / "checkpoint_4" / "capibara_manifest.json").write_text('{"kind": "final"}\n')
    (run / "metrics.jsonl").write_text('{"step": 4, "split": "train", "loss": 2.0}\n{"st')
    (run / "config.gin").write_text("TRAIN_STEPS = 4\n")
    (root / "afile").write_text("a file\n")
    (root / "bin.gin").write_bytes(bytes(range(256)))
    (root / "empty").mkdir()
    (root / "cwd").mkdir()
    return root


PATHS = ["", " ", ".", "..", "{root}/afile", "{root}/afile/x", "{root}/run",
         "{root}/run/checkpoint_4", "{root}/run/sub", "{root}/empty", "{root}/new",
         "{root}/new/a/b", "/proc/1/nope", "/dev/full", "{root}/" + "n" * 300,
         "{root}/bin.gin", "~", "/", "{root}/run/../run", "{root}/afile/../run"]
ODD_VALUES = ["", "null", "None", "???", "[", "]", "[]", "[1,2]", "[a, [b", "{a: 1}", "{",
              "'quoted'", "\"", "'", "${oc.env:HOME}", "${nope}", "${", "choice(1,2)",
              "interval(0,1)", "range(1,5)", "a b", "\\", "\u00e9\u4e2d", "nan", "inf", "-inf",
              "1e30", "-1e-30", "0", "-1", "true", "false", "9" * 5000, "x" * 300, "1_000",
              "0x10", "tag(a,b)", "glob(*)", "sort(1,2)", "shuffle(1,2)", "extend_list(1)",
              "${now:%Y}", "%gin.REQUIRED", "@fn()", "-", "--", "=", "==", "a=b"]


def _fill(text: str, root: Path) -> str:
    return text.replace("{root}", str(root))


def values() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(ODD_VALUES), st.sampled_from(PATHS),
        st.integers(-(10 ** 25), 10 ** 25).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                max_size=12))


def config_keys(config_name: str) -> list[str]:
    keys = list(config_schema.RULES_BY_CONFIG.get(config_name, {}))
    if config_name == "config":
        keys += ["model", "data", "engine", "experiment", "trainer", "optimizer", "schedule",
                 "debug", "ema", "lora", "hydra.sweeper.sampler", "hydra/sweeper",
                 "hydra.run.dir", "hydra.job.chdir", "sweeps", "gin_bindings", "gin_files"]
    return keys


def overrides(config_name: str) -> st.SearchStrategy[str]:
    key = st.one_of(st.sampled_from(config_keys(config_name)),
                    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.@/-]{0,14}", fullmatch=True))
    prefix = st.sampled_from(["", "", "", "+", "++", "~"])
    return st.builds(lambda p, k, v: f"{p}{k}={v}", prefix, key, values())


HYDRA_FLAGS = [["--cfg", "job"], ["-c", "all"], ["--help"], ["--hydra-help"], ["-m"],
               ["--package=x"], ["--resolve"], ["--info"], ["--info", "defaults"],
               ["--config-dir={root}/empty"], ["--config-dir={root}/nope"],
               ["--config-dir"], ["--cfg"], ["--config-name=nope"], ["-cn", "config"],
               ["--experimental-rerun", "{root}/afile"], ["--version"], ["--bogus"],
               ["--gin_file={root}/bin.gin"], ["--gin_file=/nope.gin"], ["--gin_file"],
               ["--gin_search_paths={root}/empty"], ["--gin_bindings=TRAIN_STEPS = 3"],
               ["--gin_bindings=nets.Nope.x = 1"], ["--gin.=1"], ["--gin.X"],
               # modes Hydra refuses together (its ValueError once surfaced as exit 1)
               ["-m", "--cfg", "job"], ["--run", "--info"], ["-sc", "-m"],
               # Hydra's subcommands for shell completion, bad and good
               ["-sc"], ["-sc", "install=tcsh"], ["-sc", "install=bash"]]


def gin_flags() -> st.SearchStrategy[list[str]]:
    name = st.sampled_from(["TRAIN_STEPS", "BASE_LEARNING_RATE", "EMB_DIM", "MODEL_DIR",
                            "TRAN_STEPS", "nets.DecoderConfig.emb_dim", "x"])
    return st.builds(lambda n, v: [f"--gin.{n}={v}"], name, values())


def hydra_args(config_name: str) -> st.SearchStrategy[list[str]]:
    flag = st.one_of(st.sampled_from(HYDRA_FLAGS), gin_flags())
    item = st.one_of(overrides(config_name).map(lambda o: [o]), flag)
    return st.lists(item, max_size=4).map(lambda parts: [a for p in parts for a in p])


def key_values(keys: list[str]) -> st.SearchStrategy[list[str]]:
    item = st.one_of(
        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(keys), st.sampled_from(PATHS)),
        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(keys), values()),
        values())
    return st.lists(item, max_size=4)


def script_args(script: str) -> st.SearchStrategy[list[str]]:
    """A generated argv for a console script (paths still hold '{root}')."""
    if script == "capibara-exp":
        return hydra_args("config")
    if script == "capibara-exp-tune-mesh":
        return hydra_args("config")
    if script == "capibara-exp-merge":
        base = st.sampled_from([["runs=[{root}/run]", "out={root}/new"], ["runs={root}/run"],
                                ["out={root}/new"], []])
        return st.builds(lambda b, rest: [*b, *rest], base, hydra_args("merge"))
    if script == "capibara-exp-data":
        return st.builds(lambda b, rest: [*b, *rest],
                         st.sampled_from([["data_dir={root}/new"], []]), hydra_args("data_build"))
    if script == "capibara-exp-meta":
        return hydra_args("meta")
    if script == "capibara-exp-plot":
        path = st.sampled_from(PATHS)
        extra = st.lists(st.one_of(st.sampled_from(["--out", "--overwrite", "-h", "--x"]),
                                   path, values()), max_size=3)
        return st.builds(lambda p, e: [p, *e], path, extra)
    if script == "capibara-exp-convert":
        command = st.sampled_from(["import", "export", "sentencepiece", "nope", ""])
        keys = ["hf_dir", "out", "name", "scan_layers", "dtype", "checkpoint", "model",
                "config_dir", "family", "max_shard_gb", "vocab_size", "model_type", "data_dir"]
        return st.builds(lambda c, kv: [c, *kv], command, key_values(keys))
    if script == "capibara-exp-lora":
        command = st.sampled_from(["export", "import", ""])
        return st.builds(lambda c, kv: [c, *kv], command, key_values(["run_dir", "out", "step"]))
    if script == "capibara-exp-generate":
        from capibara_exp.cli import generate

        base = st.sampled_from([["checkpoint={root}/run", "prompts={root}/afile",
                                 "out={root}/new/out.jsonl"], ["checkpoint={root}/run"], []])
        return st.builds(lambda b, kv: [*b, *kv], base,
                         key_values([*generate.REQUIRED, *generate.OPTIONAL]))
    raise KeyError(script)


@contextlib.contextmanager
def _replaced(targets: list[tuple[str, str]]) -> Iterator[None]:
    def accept(*args: object, **kwargs: object) -> None:
        raise Accepted()

    saved = []
    for module_name, attribute in targets:
        module = importlib.import_module(module_name)
        saved.append((module, attribute, getattr(module, attribute)))
        setattr(module, attribute, accept)
    try:
        yield
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)


def run_case(script: str, argv: list[str]) -> tuple[int, str, str]:
    """Run `script` on argv (with '{root}' filled) in a fresh sandbox; check the property.
    Returns (exit status, stderr, a problem or "")."""
    module_name, targets = SCRIPTS[script]
    main: Callable = importlib.import_module(module_name).main
    root = make_sandbox()
    argv = [_fill(a, root) for a in argv]
    # main() runs here, in-process: what it sets in os.environ (the checks export data_dir
    # for SeqIO's tasks) must not outlive the case and steer later tests.
    cwd, saved_argv, saved_env = os.getcwd(), list(sys.argv), dict(os.environ)
    err, out = io.StringIO(), io.StringIO()
    before = snapshot(root)
    try:
        os.chdir(root / "cwd")
        sys.argv = [script, *argv]
        with _replaced(targets), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main(argv)
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None
                                                                     else 1)
        after = snapshot(root)
    finally:
        os.chdir(cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        _release_locks(root)
        shutil.rmtree(root, ignore_errors=True)
    text = err.getvalue()
    return code, text, _problem(code, text, before, after)


def _problem(code: int, text: str, before: dict, after: dict) -> str:
    lines = error_lines(text)  # a started command's progress lines are not its answer
    if code not in SAFE_CODES:
        return f"exit status {code}"
    if "Traceback (most recent call last)" in text:
        return "a traceback"
    if code == 1 and "internal error:" in text:
        return "an internal error from an argument (a check is missing)"
    if code in (1, 2) and len(lines) != 1:
        return f"exit {code} with {len(lines)} lines on stderr"
    if code == 2 and before != after:
        changed = sorted(set(before.items()) ^ set(after.items()))[:3]
        return f"refused, but the sandbox changed: {changed}"
    return ""


def _release_locks(root: Path) -> None:
    from capibara_exp.base import run_lock

    for lock in root.rglob(run_lock.LOCK_NAME):
        run_lock.release(lock)


def tally(results: list[tuple[str, int]]) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for script, code in results:
        out.setdefault(script, Counter())[code] += 1
    return out
