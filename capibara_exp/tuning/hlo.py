"""An HLO module's text (`compiled.as_text()`), parsed as far as the mesh planner needs.

Computations with their instructions in the order XLA scheduled them: each instruction's
name, result type, opcode, operands and attribute text; the computations it calls
(fusions, while bodies and conditions, branches) and how many times a while loop runs.
Attributes may span lines (TPU kernels carry their metadata in multi-line frontend
attributes): an instruction is everything up to the next one. tuning/costs.py reads costs
off instructions, tuning/profile.py turns a module into the step's schedule.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

BYTES_PER_ELEMENT = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                     "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                     "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e\d+m\d+(?:fn)?)?)\[([0-9,]*)\]")
_CALLS_RE = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OPERAND_NAME_RE = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: str  # the result type text, e.g. "bf16[4,128]{1,0}" or a tuple "(f32[], s32[2])"
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the parentheses (a constant's value)

    @property
    def result_bytes(self) -> float:
        return shape_bytes(self.shape)


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction]
    shapes: dict[str, str]  # name -> result type, parameters included


def shape_bytes(shape: str) -> float:
    """Bytes of a result type; a tuple's elements add up. Layout suffixes are ignored."""
    total = 0.0
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype not in BYTES_PER_ELEMENT:
            continue
        total += BYTES_PER_ELEMENT[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def dims_of(shape: str) -> list[int]:
    """The dimensions of an array type (the first array in the text)."""
    found = _ARRAY_RE.search(shape)
    if not found:
        return []
    return [int(d) for d in found.group(2).split(",") if d]


def _split_type(rest: str) -> tuple[str, str]:
    """('(f32[], s32[2])' or 'bf16[4]{0}', the text after it) from 'TYPE opcode(...)...'."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _split_call(text: str) -> tuple[str, str, str]:
    """(opcode, operand text, attribute text) from 'opcode(operands), attrs'."""
    opcode, _, rest = text.partition("(")
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch in "({["
        depth -= ch in ")}]"
        if depth == 0:
            return opcode.strip(), rest[:i], rest[i + 1:]
    return opcode.strip(), rest, ""


def _parameters(header_params: str) -> dict[str, str]:
    """Parameter name -> type from a computation header's '(p0: f32[2], p1: (s32[], f32[]))'."""
    shapes, depth, start = {}, 0, 0
    parts = []
    for i, ch in enumerate(header_params):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(header_params[start:i])
            start = i + 1
    parts.append(header_params[start:])
    for part in parts:
        name, sep, shape = part.partition(":")
        if sep:
            shapes[name.strip().lstrip("%")] = shape.strip()
    return shapes


def parse(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text, by name."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    pending: list[str] = []  # the lines of the instruction being read

    def flush() -> None:
        if pending and current is not None:
            found = _INSTR_RE.match(" ".join(pending))
            shape, call = _split_type(found.group(3))
            opcode, operand_text, attrs = _split_call(call)
            instr = Instruction(found.group(2), opcode, shape,
                                _OPERAND_NAME_RE.findall(operand_text), attrs, operand_text)
            current.instructions.append(instr)
            current.shapes[instr.name] = shape
        pending.clear()

    for line in text.splitlines():
        if current is None:
            header = _HEADER_RE.match(line)
            if header:
                current = Computation(header.group(2), bool(header.group(1)), [],
                                      _parameters(header.group(3)))
            continue
        if line.strip() == "}":
            flush()
            comps[current.name] = current
            current = None
        elif _INSTR_RE.match(line):
            flush()
            pending.append(line)
        elif pending:  # a continuation of the instruction's attributes
            pending.append(line.strip())
    return comps


def callees(instr: Instruction) -> Iterator[tuple[str, str]]:
    """(role, computation) pairs an instruction calls: calls/to_apply/body/condition/branch."""
    for role, name in _CALLS_RE.findall(instr.attrs):
        yield role, name
    branches = _BRANCHES_RE.search(instr.attrs)
    if branches:
        for name in branches.group(1).split(","):
            yield "branch", name.strip().lstrip("%")



def _constant(comp: Computation, name: str) -> int | None:
    instr = next((i for i in comp.instructions if i.name == name), None)
    if instr is None or instr.opcode != "constant":
        return None
    return int(instr.args) if re.fullmatch(r"-?\d+", instr.args.strip()) else None


def trip_count(loop: Instruction, caller: Computation, comps: dict[str, Computation]
               ) -> float | None:
    """Iterations of a while loop: XLA's known_trip_count, or read off a `counter < N`
    condition (what lax.scan and fori_loop lower to) with the counter's initial value."""
    known = _TRIP_RE.search(loop.attrs)
    if known:
        return float(known.group(1))
    cond_name = dict(_CALLS_RE.findall(loop.attrs)).get("condition")
    cond = comps.get(cond_name or "")
    if cond is None or not cond.instructions:
        return None
    root = cond.instructions[-1]
    direction = re.search(r"direction=(LT|LE|GT|GE)", root.attrs)
    if root.opcode != "compare" or not direction or len(root.operands) != 2:
        return None
    by_name = {i.name: i for i in cond.instructions}
    counter, limit = (by_name.get(o) for o in root.operands)
    if direction.group(1) in ("GT", "GE"):
        counter, limit = limit, counter
    if counter is None or limit is None or counter.opcode != "get-tuple-element":
        return None
    bound = _constant(cond, limit.name)
    index = re.search(r"index=(\d+)", counter.attrs)
    if bound is None or not index:
        return None
    start = 0
    init = next((i for i in caller.instructions if loop.operands and i.name == loop.operands[0]),
                None)
    if init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
        start = _constant(caller, init.operands[int(index.group(1))]) or 0
    inclusive = direction.group(1) in ("LE", "GE")
    return float(max(bound - start + inclusive, 0))
