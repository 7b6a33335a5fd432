"""The seqio task of execution-scored code generation from E2B logs, registered on import.

`capibara_e2b_codegen`: one example per logged Python cell that ran without an error and
printed something; `inputs` is the cell's first half of lines (at least one), `targets` the
rest, and the logged stdout is kept to score against. Its metric runs prompt + prediction
in the execution sandbox (generation/scoring.py: pass@k for the configured k and their
intervals, under T5X's metric names). Logs: $CAPIBARA_CODEGEN_LOGS (an E2B-format JSONL),
else the collected logs of the built data ($CAPIBARA_DATA_DIR/.../logs/collected.jsonl).
Splits: every 5th record is validation, the rest train.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import seqio
import tensorflow as tf

from capibara_exp.base.errors import ConfigError
from capibara_exp.data.e2b import built
from capibara_exp.data.tasks import VOCABULARY, data_dir
from capibara_exp.generation import scoring

TASK = "capibara_e2b_codegen"
LOGS_ENV = built.CODEGEN_LOGS_ENV


def features(vocabulary: seqio.Vocabulary | None = None) -> dict:
    """inputs (the program's start) and targets (the rest, then EOS) in `vocabulary` (the
    byte vocabulary by default)."""
    vocabulary = vocabulary or VOCABULARY
    return {"inputs": seqio.Feature(vocabulary, add_eos=False),
            "targets": seqio.Feature(vocabulary, add_eos=True)}


def logs_path() -> Path:
    """$CAPIBARA_CODEGEN_LOGS, else the collected logs of the data build (never built here:
    the run's data preparation builds them); a ConfigError saying how when there are none."""
    if os.environ.get(LOGS_ENV):
        path = Path(os.environ[LOGS_ENV])
    else:
        built.manifest(data_dir())  # NotBuilt: the command that builds them
        path = built.dataset_dir(data_dir()) / "logs" / "collected.jsonl"
    if not path.is_file():
        raise ConfigError(f"{TASK}: no E2B logs at {path}; set ${LOGS_ENV} to an E2B-format "
                          "JSONL file or collect some with capibara-exp-data")
    return path


def examples(path: Path) -> list[dict]:
    """(prompt, rest, logged stdout) of each scoreable Python record, in file order."""
    from capibara_exp.data.e2b import quarantine, records

    out = []
    q = quarantine.Quarantine()
    for r in records.parse_records(path, q):
        lines = r.code.splitlines(keepends=True)
        if r.language != "python" or r.execution.error is not None or not r.stdout.strip() \
                or len(lines) < 2:
            continue
        cut = max(1, len(lines) // 2)
        out.append({"prompt": "".join(lines[:cut]), "rest": "".join(lines[cut:]),
                    "stdout": r.stdout})
    return out


def _dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del shuffle_files, seed
    rows = [e for i, e in enumerate(examples(logs_path()))
            if (i % 5 == 4) == (split == "validation")]
    return tf.data.Dataset.from_tensor_slices({
        "inputs": tf.constant([r["prompt"] for r in rows], tf.string),
        "targets": tf.constant([r["rest"] for r in rows], tf.string),
        "stdout": tf.constant([r["stdout"] for r in rows], tf.string),
    })


def postprocess(output: str, example: dict | None = None, is_target: bool = False):
    """Targets become what scoring needs (the prompt and the logged stdout)."""
    if not is_target:
        return output
    text = lambda k: example[k].decode("utf-8") if isinstance(example[k], bytes) else example[k]  # noqa: E731
    return {"prompt": text("inputs_pretokenized"), "stdout": text("stdout")}


def register(name: str = TASK, replace: bool = False,
             vocabulary: seqio.Vocabulary | None = None, **metric_options) -> str:
    """The task under `name` in `vocabulary`, its metric given `metric_options`
    (scoring.codegen_metric's ks, mode, checker, ...); `replace` registers it again."""
    if replace and name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(name)
    if name not in seqio.TaskRegistry.names():
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(_dataset_fn, splits=("train", "validation")),
            preprocessors=[seqio.preprocessors.tokenize_and_append_eos],
            output_features=features(vocabulary),
            postprocess_fn=postprocess,
            metric_fns=[functools.partial(scoring.codegen_metric, **metric_options)],
        )
    return name


def configured(name: str = TASK, vocabulary: seqio.Vocabulary | None = None, pass_ks=(1,),
               mode: str = "stdout", checker: str | None = None) -> str:
    """The task registered again in the model's vocabulary and with the inference eval's
    scoring settings; its name (the same: metric names stay `<task>/pass@k`), which
    gin/runs/infer_eval_codegen.gin binds as the eval's mixture_or_task_name, so both
    engines tokenize and score alike."""
    return register(name, replace=True, vocabulary=vocabulary,
                    ks=tuple(int(k) for k in pass_ks), mode=mode, checker=checker)


register()
