"""Validating a record against record.schema.json (shipped in the package) with jsonschema.

The reason and detail of a failure name the JSON path and what the schema wants, never
the value found there (a value can be a secret): `$.logs.stdout: expected array, got
null`. The SDK's `Execution.to_json()` writes `logs` and `error` as JSON text inside the
JSON; in the flat shape those strings are decoded (with the same strict rules as a line)
before validation.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import jsonschema
from jsonschema import Draft202012Validator

from capibara_exp.data.e2b import jsonl
from capibara_exp.data.e2b.reasons import (
    INVALID_VALUE,
    MISSING_FIELD,
    OUT_OF_RANGE,
    WRONG_TYPE,
)

NESTED, SDK = "nested", "sdk"
_REASONS = {
    "type": WRONG_TYPE,
    "required": MISSING_FIELD,
    "minimum": OUT_OF_RANGE,
    "maximum": OUT_OF_RANGE,
    "exclusiveMinimum": OUT_OF_RANGE,
}
_FLAT_REQUIRED = ("results", "logs", "error")
_SHAPES = (
    " (a record holds either `execution` (nested shape) or results, logs and error at the"
    " top, as E2B's Execution.to_json() writes them)"
)
_JSON_TYPES = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    type(None): "null",
    int: "integer",
    float: "number",
}


class RecordError(ValueError):
    """A JSON object that is not an execution record; `reason` is a quarantine reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@functools.cache
def schema() -> dict:
    return json.loads(resources.files(__package__).joinpath("record.schema.json").read_text())


@functools.cache
def _validator() -> Draft202012Validator:
    Draft202012Validator.check_schema(schema())
    return Draft202012Validator(schema())


@functools.cache
def known_keys() -> frozenset[str]:
    """Top-level keys the schema names (other keys are ignored, and counted)."""
    defs = schema()["$defs"]
    return (
        frozenset(defs["cell"]["properties"])
        | frozenset(defs["execution"]["properties"])
        | {"execution"}
    )


def shape(obj: dict) -> str:
    return NESTED if "execution" in obj else SDK


def json_path(parts) -> str:
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}"
        else:
            out += f"[{part[:40]!r}]"
    return out


def _type_name(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _describe(err: jsonschema.ValidationError) -> tuple[str, str]:
    path, kind = json_path(err.absolute_path), err.validator
    if "x-message" in err.schema and kind == "not":
        return INVALID_VALUE, f"{path}: {err.schema['x-message']}"
    if kind == "type":
        want = err.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        return WRONG_TYPE, f"{path}: expected {want}, got {_type_name(err.instance)}"
    if kind == "required":
        missing = [k for k in err.validator_value if k not in err.instance]
        hint = _SHAPES if not err.absolute_path and missing[0] in _FLAT_REQUIRED else ""
        return MISSING_FIELD, f"{json_path([*err.absolute_path, missing[0]])}: missing{hint}"
    if kind == "enum":
        allowed = ", ".join(map(str, err.validator_value))
        got = err.instance if isinstance(err.instance, str) and len(err.instance) <= 20 else None
        shown = f"got {got!r}" if got is not None else f"got a {_type_name(err.instance)}"
        return INVALID_VALUE, f"{path}: must be one of {allowed}, {shown}"
    if kind in ("minimum", "maximum", "exclusiveMinimum"):
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">"}[kind]
        return OUT_OF_RANGE, f"{path}: must be {op} {err.validator_value}, got {err.instance}"
    if kind == "minLength":
        return INVALID_VALUE, f"{path}: must not be empty"
    return _REASONS.get(kind, INVALID_VALUE), f"{path}: does not match the schema ({kind})"


def _decode_text_fields(obj: dict) -> dict:
    """The flat shape with `logs`/`error` given as JSON text (Execution.to_json) decoded."""
    if shape(obj) != SDK:
        return obj
    out = dict(obj)
    for key in ("logs", "error"):
        if isinstance(out.get(key), str):
            try:
                out[key] = jsonl.loads(out[key])
            except jsonl.BadLine as err:
                raise RecordError(
                    err.reason, f"$.{key} (JSON text, as Execution.to_json writes it): {err.detail}"
                ) from None
            if out[key] is not None and not isinstance(out[key], dict):
                raise RecordError(
                    WRONG_TYPE, f"$.{key}: JSON text of a {_type_name(out[key])}, not an object"
                )
    return out


def validate(obj: dict) -> dict:
    """The object ready to read (JSON-text fields decoded), or RecordError naming the path."""
    obj = _decode_text_fields(obj)
    err = jsonschema.exceptions.best_match(_validator().iter_errors(obj))
    if err is not None:
        raise RecordError(*_describe(err))
    return obj
