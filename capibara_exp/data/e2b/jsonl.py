"""Reading JSONL strictly: one JSON object per line, or a quarantine entry saying why not.

Strict where leniency would hide data loss or crash a later step: bytes that are not
UTF-8, raw control characters, duplicate keys (json keeps the last one silently), NaN and
Infinity (not JSON), integer literals over Python's 4,300-digit conversion limit, nesting
deeper than anything real, and lone UTF-16 surrogate escapes ("\\udc00": valid JSON
syntax, but no Unicode text, so no UTF-8 file can hold it). Every other string is kept
as it is: any script, emoji sequences, invisible formatting characters.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

from capibara_exp.data.e2b.quarantine import Quarantine
from capibara_exp.data.e2b.reasons import (
    BINARY_GARBAGE,
    DUPLICATE_KEY,
    EMPTY_FILE,
    INVALID_JSON,
    INVALID_UNICODE,
    INVALID_UTF8,
    OVERSIZED_LINE,
    TOO_DEEP,
    TRUNCATED_JSON,
    WRONG_TYPE,
)

# Deeper JSON is quarantined: nothing real nests this far, and deeper values would
# overflow the recursion of the code that reads them later.
MAX_DEPTH = 100
# int() refuses longer decimal strings (CPython's guard against quadratic conversion).
MAX_INT_DIGITS = 4300
_BOM = "\ufeff"
# Raw C0 controls other than tab/CR/LF, and DEL: JSON text holds them only escaped.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class BadLine(ValueError):
    """A line that is not a usable JSON object: a quarantine reason, a detail, a char offset."""

    def __init__(self, reason: str, detail: str, offset: int | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.offset = reason, detail, offset


class _Duplicated(dict):
    """An object that had a key twice (the pairs are kept to name the key)."""

    def __init__(self, pairs: list, duplicates: list[str]):
        super().__init__(pairs)
        self.duplicates = duplicates


def _pairs(pairs: list) -> dict:
    seen: set[str] = set()
    dups = [k for k, _ in pairs if k in seen or seen.add(k)]
    return _Duplicated(pairs, dups) if dups else dict(pairs)


def _reject_constant(name: str):
    raise BadLine(INVALID_JSON, f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BadLine(
            INVALID_JSON, f"an integer literal of {len(digits)} digits (over {MAX_INT_DIGITS})"
        )
    return int(digits)


def loads(text: str):
    """json.loads with the strict rules above; raises BadLine (nothing else)."""
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_int=_int, object_pairs_hook=_pairs
        )
    except BadLine:
        raise
    except RecursionError:
        raise BadLine(TOO_DEEP, "nested too deep to parse") from None
    except json.JSONDecodeError as err:
        reason = TRUNCATED_JSON if looks_truncated(text) else INVALID_JSON
        raise BadLine(reason, f"{err.msg} at char {err.pos}", err.pos) from None
    except ValueError as err:  # what else the parser's own conversions refuse
        raise BadLine(INVALID_JSON, f"{type(err).__name__} while parsing") from None
    check_value(value)
    return value


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{path}[{key!r}]"


def _surrogate(text: str) -> int | None:
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            return i
    return None


def check_value(obj, root: str = "$") -> None:
    """Raise BadLine naming the JSON path of a value no later step can use."""
    stack = [(obj, root, 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            at = _surrogate(value)
            if at is not None:
                raise BadLine(
                    INVALID_UNICODE,
                    f"{path}: a lone UTF-16 surrogate (\\u{ord(value[at]):04x}) at char {at}: "
                    "not Unicode text",
                )
        elif isinstance(value, float) and not math.isfinite(value):
            raise BadLine(INVALID_JSON, f"{path}: a number out of range")
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise BadLine(TOO_DEEP, f"{path}: nested deeper than {MAX_DEPTH} levels")
            if isinstance(value, _Duplicated):
                names = ", ".join(sorted({repr(k)[:40] for k in value.duplicates}))
                raise BadLine(DUPLICATE_KEY, f"{path}: key {names} appears more than once")
            if isinstance(value, dict):
                for key, item in value.items():
                    at = _surrogate(key)
                    if at is not None:
                        raise BadLine(INVALID_UNICODE, f"{path}: a key holds a lone surrogate")
                    stack.append((item, _key_path(path, key), depth + 1))
            else:
                stack += [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]


def decode_line(raw: bytes, first: bool = False):
    """The JSON object of one line (without its line ending); raises BadLine."""
    body = raw.rstrip(b"\r\n")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        # Cut inside a multi-byte character (the first bad byte is an unfinished one at the
        # end): the writer stopped mid-record if what comes before is a cut document.
        head = body[: err.start].decode("utf-8", "replace")
        if err.reason == "unexpected end of data" and head.strip() and looks_truncated(head):
            raise BadLine(TRUNCATED_JSON, "cut inside a UTF-8 character", err.start) from None
        raise BadLine(
            INVALID_UTF8, f"not UTF-8: {err.reason} at byte {err.start}", err.start
        ) from None
    if first and text.startswith(_BOM):
        text = text[1:]  # a byte-order mark opening the file (editors write one) is no data
    controls = len(_CONTROL.findall(text))
    if "\x00" in text or controls > 0.1 * len(text):
        raise BadLine(BINARY_GARBAGE, f"{controls} raw control characters: not a text line")
    obj = loads(text)
    if not isinstance(obj, dict):
        raise BadLine(WRONG_TYPE, f"$: a line must be a JSON object, got {type(obj).__name__}")
    return obj


def read_json_lines(
    path: Path, quarantine: Quarantine, max_line_bytes: int
) -> Iterator[tuple[int, dict]]:
    """Yield (line_no, object) for every line of a JSONL file that is a JSON object.

    Each other line is quarantined with its reason; an empty file is one entry.
    """
    source, any_line = str(path), False
    with open(path, "rb") as f:
        for line_no, raw, size in _bounded_lines(f, max_line_bytes):
            if size is not None:
                any_line = True
                detail = f"{size} bytes > max_line_bytes={max_line_bytes}"
                quarantine.add(source, line_no, OVERSIZED_LINE, detail, raw)
                continue
            if not raw.strip():
                continue
            any_line = True
            try:
                yield line_no, decode_line(raw, first=line_no == 1)
            except BadLine as err:
                quarantine.add(source, line_no, err.reason, err.detail, raw, err.offset)
    if not any_line:
        quarantine.add(source, 0, EMPTY_FILE, "the file has no lines")


def _bounded_lines(f, max_line_bytes: int):
    """(line_no, bytes, None) per line; an oversized line is (line_no, its head, its size).

    No more than max_line_bytes + 1 bytes of a line are ever held: the rest of a longer
    line is read in chunks and dropped.
    """
    line_no = 0
    while chunk := f.readline(max_line_bytes + 1):
        line_no += 1
        if chunk.endswith(b"\n") or len(chunk) <= max_line_bytes:
            yield line_no, chunk, None
            continue
        size, rest = len(chunk), b""
        while not rest.endswith(b"\n") and (rest := f.readline(1 << 16)):
            size += len(rest)
        yield line_no, chunk[:4096], size - rest.endswith(b"\n")


_LITERALS = ("true", "false", "null")
_LAST_WORD = re.compile(r"[A-Za-z0-9.+\-]*$")
# What a cut document may still need before its closing brackets: nothing, a value, the
# value of a key, a key and its value.
_FILLERS = ("", "null", ":null", '"":null')


def _parses(text: str) -> bool:
    try:
        json.loads(text, parse_constant=_reject_constant, parse_int=_int)
        return True
    except (ValueError, RecursionError):
        return False


def looks_truncated(text: str) -> bool:
    """Whether `text` is the start of a JSON document cut short (not a broken one).

    It is if it parses once its last token is completed (a literal, a number, an escape or
    a string) and what it opened is closed; a text that is wrong before its end never does.
    """
    closers, in_string, escape, hex_left = [], False, False, 0
    for ch in text:
        if in_string:
            if hex_left:
                hex_left -= 1
            elif escape:
                escape, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            closers.append("]" if ch == "[" else "}")
        elif ch in "]}" and (not closers or closers.pop() != ch):
            return False
    if in_string:
        head = (text[:-1] if escape else text) + "0" * hex_left + '"'
    else:
        head = text.rstrip()
        word = _LAST_WORD.search(head).group()
        literal = next((lit for lit in _LITERALS if word and lit.startswith(word)), None)
        if literal:
            head += literal[len(word) :]
        elif word[-1:] in ("-", "+", ".", "e", "E"):
            head += "0"
    tail = "".join(reversed(closers))
    return any(_parses(head + filler + tail) for filler in _FILLERS)
