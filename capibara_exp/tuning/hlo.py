"""What one device does in a compiled step, read from its optimized HLO text.

XLA's `cost_analysis()` counts a while loop's body once (a `lax.scan` over microbatches or
layers) and gives no per-op split, so it can neither count a microbatched step nor feed a
per-op roofline. This module reads `compiled.as_text()` instead: every instruction with
its shape, the computations each one calls, and how many times each computation runs
(while loops with a known trip count multiply their bodies). From that it sums, per
device and per step:

- matmul FLOPs: `dot` and `convolution` ops (TPU lowers einsums to convolutions, batch
  dimensions to base-dilated windows), inside fusions or not;
- HBM traffic: bytes read and written by each top-level op (a fusion reads its operands
  and writes its result once; ops inside a fusion stay in vector memory);
- collectives: the bytes and group size of every all-reduce, all-gather, reduce-scatter,
  all-to-all and collective-permute.

The parser reads the text format only as far as these need: names, shapes, opcodes,
operands and the few attributes that carry sizes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

BYTES_PER_ELEMENT = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                     "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                     "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Bumped when the profile would read the same HLO differently: cached results re-read
# their saved HLO (tuning/plan.py) instead of keeping stale estimates.
PROFILE_VERSION = 2
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Ops that move no data of their own: views, tuples, control, and the second half of
# async pairs (the `-start` op carries the shapes).
_FREE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
             "partition-id", "replica-id", "iota", "while", "conditional", "call",
             "opt-barrier", "add-dependency", "domain"}
_DONE_SUFFIX = "-done"

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


@dataclasses.dataclass
class Collective:
    opcode: str
    bytes: float  # the payload: operand bytes (all-reduce, reduce-scatter, all-to-all,
    #               collective-permute) or result bytes (all-gather)
    group_size: int
    count: float  # how many times it runs per step


@dataclasses.dataclass
class StepProfile:
    """Per-device totals of one compiled step."""

    flops: float  # matmul FLOPs
    hbm_bytes: float
    collectives: list[Collective]
    # (flops, bytes) of each top-level op times its count, for a per-op roofline
    ops: list[tuple[float, float, float]]

    @property
    def collective_bytes(self) -> float:
        return sum(c.bytes * c.count for c in self.collectives)


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
    for line in text.splitlines():
        if current is None:
            header = _HEADER_RE.match(line)
            if header:
                current = Computation(header.group(2), bool(header.group(1)), [],
                                      _parameters(header.group(3)))
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        found = _INSTR_RE.match(line)
        if not found:
            continue
        shape, call = _split_type(found.group(3))
        opcode, operand_text, attrs = _split_call(call)
        instr = Instruction(found.group(2), opcode, shape,
                            _OPERAND_NAME_RE.findall(operand_text), attrs, operand_text)
        current.instructions.append(instr)
        current.shapes[instr.name] = shape
    return comps


def _callees(instr: Instruction) -> Iterator[tuple[str, str]]:
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


def counts(comps: dict[str, Computation]) -> tuple[dict[str, float], set[str]]:
    """(times each computation runs per step, names of fused computations).

    A while body and condition run trip_count times per run of their caller (once where the
    count cannot be read: an undercount, as in cost_analysis); a conditional's
    branches are counted as if each ran (an upper bound)."""
    entry = next(c for c in comps.values() if c.is_entry)
    runs: dict[str, float] = defaultdict(float)
    fused: set[str] = set()
    runs[entry.name] = 1.0
    order = [entry.name]
    seen = {entry.name}
    # Computations are called from their callers only; visit callers first.
    while order:
        name = order.pop(0)
        comp = comps.get(name)
        if comp is None:
            continue
        for instr in comp.instructions:
            trip = trip_count(instr, comp, comps) if instr.opcode == "while" else None
            for role, callee in _callees(instr):
                times = trip if (trip is not None and role in ("body", "condition")) else 1.0
                if role == "calls" and instr.opcode == "fusion":
                    fused.add(callee)
                if role == "to_apply":
                    continue  # scalar reducers: their work is the caller's op
                runs[callee] += runs[name] * times
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    return dict(runs), fused


def _window(attrs: str, key: str, rank: int, default: int) -> list[int]:
    found = re.search(rf"\b{key}=([\d_x]+)", attrs)
    if not found:
        return [default] * rank
    return [int(v) for v in found.group(1).split("x")]


def _real_taps(n: int, size: int, stride: int, pad_lo: int, out_n: int, lhs_dilate: int,
               rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one spatial dimension that read a real input
    element, not padding or a hole of a base dilation (how XLA's TPU lowering expresses
    einsum batch dimensions and gradients)."""
    pos = (np.arange(out_n)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - pad_lo)
    real = (pos >= 0) & (pos <= (n - 1) * lhs_dilate) & (pos % lhs_dilate == 0)
    return int(real.sum())


def _conv_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    """2 x multiply-adds: (batch x output features) x input features x the window taps that
    land on real input positions, summed over output positions."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
    if not labels or len(instr.operands) < 2:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    lhs = dims_of(shapes.get(instr.operands[0], ""))
    rhs = dims_of(shapes.get(instr.operands[1], ""))
    out = dims_of(instr.shape)
    if (len(lhs), len(rhs), len(out)) != (len(lhs_labels), len(rhs_labels), len(out_labels)):
        return 0.0
    spatial = sorted(c for c in out_labels if c.isdigit())
    rank = len(spatial)
    window = re.search(r"window=\{([^}]*)\}", instr.attrs)
    w = window.group(1) if window else ""
    sizes = _window(w, "size", rank, 1)
    strides = _window(w, "stride", rank, 1)
    lhs_dil = _window(w, "lhs_dilate", rank, 1)
    rhs_dil = _window(w, "rhs_dilate", rank, 1)
    pads = re.search(r"\bpad=([\d_x-]+)", w)
    pad_lo = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * rank
    taps = 1
    for i, digit in enumerate(spatial):
        taps *= _real_taps(lhs[lhs_labels.index(digit)], sizes[i], strides[i], pad_lo[i],
                           out[out_labels.index(digit)], lhs_dil[i], rhs_dil[i])
    batch_features = out[out_labels.index("b")] * out[out_labels.index("f")]
    return 2.0 * batch_features * rhs[rhs_labels.index("i")] * taps


def _dot_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    """2 x output elements x the product of the lhs contracting dimensions."""
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    lhs_dims = dims_of(shapes.get(instr.operands[0], "")) if instr.operands else []
    if not contracting or not lhs_dims:
        return 0.0
    k = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d)
    return 2.0 * math.prod(dims_of(instr.shape)) * k


def matmul_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    if instr.opcode == "convolution":
        return _conv_flops(instr, shapes)
    if instr.opcode == "dot":
        return _dot_flops(instr, shapes)
    return 0.0


def group_size(attrs: str, num_devices: int) -> int:
    """Devices taking part in one group of a collective, from any of XLA's spellings."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        axes = re.findall(r"'([^']+)'", mesh.group(2))
        return math.prod(int(sizes[a]) for a in axes if a in sizes) or 1
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    if "source_target_pairs" in attrs:
        return 2
    return num_devices  # replica_groups={}: every device


_SLICES = ("dynamic-slice", "slice")
_VIEWS = ("bitcast", "reshape", "copy")


def _users(comp: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = defaultdict(list)
    for instr in comp.instructions:
        for operand in instr.operands:
            users[operand].append(instr)
    return users


def _read_bytes(name: str, full: float, users: dict[str, list[Instruction]]) -> float:
    """Bytes an op reads of one input: only the slices where slicing is all it does with it
    (a scan reading layer i of stacked weights), none where it is the buffer an in-place
    dynamic-update-slice writes into, else all of it."""
    uses = users.get(name, [])
    if not uses:
        return 0.0
    read = 0.0
    for use in uses:
        if use.opcode in _SLICES and use.operands[0] == name:
            read += use.result_bytes
        elif use.opcode == "dynamic-update-slice" and use.operands[0] == name:
            continue
        elif use.opcode in _VIEWS and len(use.operands) == 1:
            read += _read_bytes(use.name, full, users)
        else:
            return full
    return min(read, full)


def _written_bytes(instr: Instruction, comp: Computation) -> float:
    """Bytes an op writes: a dynamic-update-slice writes its update, in place."""
    if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
        return shape_bytes(comp.shapes.get(instr.operands[1], ""))
    if instr.opcode == "tuple":
        by_name = {i.name: i for i in comp.instructions}
        return sum(_written_bytes(by_name[o], comp) if o in by_name else
                   shape_bytes(comp.shapes.get(o, "")) for o in instr.operands)
    return instr.result_bytes


def _op_bytes(instr: Instruction, comp: Computation, comps: dict[str, Computation]) -> float:
    """HBM bytes of one top-level op: what it reads of its operands plus what it writes."""
    if instr.opcode in _SLICES:
        return 2.0 * instr.result_bytes
    if instr.opcode == "dynamic-update-slice":
        return 2.0 * _written_bytes(instr, comp)
    callee = next((c for r, c in _callees(instr) if r == "calls"), None)
    body = comps.get(callee or "") if instr.opcode == "fusion" else None
    if body is None or not body.instructions:
        return (sum(shape_bytes(comp.shapes.get(o, "")) for o in instr.operands)
                + instr.result_bytes)
    params = {int(i.args): i.name for i in body.instructions
              if i.opcode == "parameter" and i.args.strip().isdigit()}
    users = _users(body)
    read = sum(_read_bytes(params[k], shape_bytes(comp.shapes.get(o, "")), users)
               if k in params else shape_bytes(comp.shapes.get(o, ""))
               for k, o in enumerate(instr.operands))
    return read + _written_bytes(body.instructions[-1], body)


def _collective(instr: Instruction, comp: Computation, num_devices: int, times: float
                ) -> Collective:
    base = instr.opcode.removesuffix("-start")
    operand_bytes = sum(shape_bytes(comp.shapes.get(o, "")) for o in instr.operands)
    payload = instr.result_bytes if base == "all-gather" else operand_bytes
    if instr.opcode.endswith("-start") and base == "all-gather":
        payload = instr.result_bytes / 2  # ((operand), (result)) tuple
    return Collective(base, payload, group_size(instr.attrs, num_devices), times)


def profile(text: str, num_devices: int) -> StepProfile:
    """Per-device FLOPs, HBM bytes, collectives and per-op costs of one compiled step.

    Collectives count wherever they are, fusions included (TPU wraps some in async
    collective fusions); FLOPs and bytes count per top-level op, a fusion's from its body."""
    comps = parse(text)
    runs, fused = counts(comps)
    memo: dict[str, float] = {}

    def fused_flops(name: str) -> float:
        """Matmul FLOPs of a fused computation, fusions nested in it included."""
        if name not in memo:
            comp = comps[name]
            memo[name] = sum(matmul_flops(i, comp.shapes)
                             + sum(fused_flops(c) for r, c in _callees(i)
                                   if r == "calls" and c in comps)
                             for i in comp.instructions)
        return memo[name]

    total_flops = total_bytes = 0.0
    collectives: list[Collective] = []
    ops: list[tuple[float, float, float]] = []
    for name, times in runs.items():
        comp = comps.get(name)
        if comp is None or times == 0:
            continue
        for instr in comp.instructions:
            if instr.opcode.removesuffix("-start") in COLLECTIVES:
                collectives.append(_collective(instr, comp, num_devices, times))
                continue
            if name in fused or instr.opcode in _FREE_OPS or instr.opcode.endswith(_DONE_SUFFIX):
                continue
            flops = matmul_flops(instr, comp.shapes)
            for role, callee in _callees(instr):
                if role == "calls" and callee in fused and callee in comps:
                    flops += fused_flops(callee)
            moved = _op_bytes(instr, comp, comps)
            total_flops += flops * times
            total_bytes += moved * times
            ops.append((flops, moved, times))
    return StepProfile(total_flops, total_bytes, collectives, ops)
