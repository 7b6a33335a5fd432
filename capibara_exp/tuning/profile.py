"""A compiled step as its schedule: what one device does, in the order XLA scheduled it.

XLA's `cost_analysis()` counts a while loop's body once and gives no order, so it can tell
neither a microbatched step's work nor which collectives hide behind compute. This module
reads `compiled.as_text()` (scheduled HLO) into a StepProfile: for the entry computation
and every while body or called computation it reaches, a list of events in schedule order:

- ("op", flops, bytes): a top-level op (a fusion, a Pallas kernel, a copy...) with its
  matmul FLOPs and HBM bytes (tuning/costs.py);
- ("sync", collective): a collective the core waits for;
- ("start", key, collective) ... ("done", key): an asynchronous collective, running on the
  interconnect between the two while the core computes what is scheduled between them
  (`*-start`/`*-done` pairs, and TPU's async collective fusions: a fusion whose root is
  AsyncCollectiveStart / AsyncCollectiveDone, paired by channel id; the continuation
  fusions in between hold a copy of the collective and count as compute only);
- ("overlap", flops, bytes, collective): a fusion that computes while a collective it holds
  runs (a collective fused with compute that no start announced);
- ("loop", body, trips), ("call", computation), ("branches", [computations]).

Across slices, XLA reduces within each slice over ICI and hands the rest to the megascale
runtime as send/recv host transfers over DCN; a send becomes an asynchronous collective
over the slices, done at its send-done.

A collective is (opcode, payload bytes, group size, ICI axes and slices its group spans).
The profile is plain JSON-able data: the planner caches it, and bench/calibrate.py keeps
the four MaxText configurations' profiles (bench/calibration/) to refit without compiling.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from capibara_exp.tuning import costs, hlo
from capibara_exp.tuning.hlo import COLLECTIVES, Computation, Instruction, shape_bytes

# Bumped when the profile would read the same HLO differently: cached results re-read
# their saved HLO (tuning/plan.py) instead of keeping stale estimates.
PROFILE_VERSION = 3
# Ops that cost nothing of their own: views, tuples, control, and the completions of async
# copies (their start carries the shapes).
_FREE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
             "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain"}
_DMA_STARTS = ("copy-start", "slice-start")
_CHANNEL_RE = re.compile(r"channel_id=(\d+)")
# Across slices XLA lowers a collective to a host transfer the megascale runtime carries
# over DCN: send/recv pairs tagged with the collective they are part of.
_MEGASCALE_RE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_TARGET_RE = re.compile(r'custom_call_target="(\w+)"')


@dataclasses.dataclass
class Collective:
    opcode: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    bytes: float  # payload: the gathered result (all-gather) or the operand (the others)
    group_size: int
    ici_axes: int = 1  # physical torus axes the group's members span
    slices: int = 1  # slices (joined over DCN) the group spans
    count: float = 1.0  # times it runs per step (in StepProfile.collectives)


@dataclasses.dataclass
class StepProfile:
    """The schedule of one compiled step, per device, and its totals."""

    entry: str
    programs: dict[str, list[list[Any]]]  # computation -> events (see the module doc)
    flops: float = 0.0  # matmul FLOPs per step (Pallas kernels included)
    hbm_bytes: float = 0.0
    collectives: list[Collective] = dataclasses.field(default_factory=list)

    @property
    def collective_bytes(self) -> float:
        return sum(c.bytes * c.count for c in self.collectives)

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "programs": self.programs, "version": PROFILE_VERSION}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepProfile:
        return with_totals(cls(data["entry"], data["programs"]))


def _collective(instr: Instruction, comp: Computation, num_devices: int,
                coords: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    base = instr.opcode.removesuffix("-start")
    operand_bytes = sum(shape_bytes(comp.shapes.get(o, "")) for o in instr.operands)
    payload = instr.result_bytes if base == "all-gather" else operand_bytes
    if instr.opcode.endswith("-start") and base == "all-gather":
        payload = instr.result_bytes / 2  # ((operand), (result)) tuple
    members = costs.group_members(instr.attrs, num_devices)
    axes, slices = costs.span(members, coords)
    return dataclasses.asdict(Collective(base, payload, len(members), axes, slices))


class _Reader:
    """Builds the events of each computation the entry reaches (not fusion bodies)."""

    def __init__(self, comps: dict[str, Computation], num_devices: int,
                 coords: Sequence[Sequence[int]] | None):
        self.comps, self.num_devices, self.coords = comps, num_devices, coords
        self.memo: dict[str, float] = {}

    def fused_flops(self, name: str) -> float:
        """Matmul FLOPs of a fused computation, fusions nested in it included."""
        if name not in self.memo:
            comp = self.comps[name]
            self.memo[name] = sum(costs.matmul_flops(i, comp.shapes)
                                  + sum(self.fused_flops(c) for r, c in hlo.callees(i)
                                        if r == "calls" and c in self.comps)
                                  for i in comp.instructions)
        return self.memo[name]

    def fused_collectives(self, body: Computation) -> list[tuple[str, dict[str, Any]]]:
        """(channel, collective) of the collectives in a fusion body, nested fusions included."""
        out = []
        for instr in body.instructions:
            if instr.opcode.removesuffix("-start") in COLLECTIVES:
                channel = _CHANNEL_RE.search(instr.attrs)
                out.append((channel.group(1) if channel else instr.name,
                            _collective(instr, body, self.num_devices, self.coords)))
            for role, callee in hlo.callees(instr):
                if role == "calls" and callee in self.comps:
                    out += self.fused_collectives(self.comps[callee])
        return out

    def fusion(self, instr: Instruction, comp: Computation, started: set[str]) -> list:
        body = self.comps.get(next((c for r, c in hlo.callees(instr) if r == "calls"), ""))
        flops = self.fused_flops(body.name) if body else 0.0
        moved = costs.op_bytes(instr, comp, self.comps)
        held = self.fused_collectives(body) if body else []
        if not held:
            return [["op", flops, moved]]
        root = body.instructions[-1]
        target = _TARGET_RE.search(root.attrs) if root.opcode == "custom-call" else None
        channel, collective = held[0]
        if target and target.group(1) == "AsyncCollectiveStart":
            started.add(channel)
            return [["start", channel, collective]]
        if target and target.group(1) == "AsyncCollectiveDone":
            return [["done", channel]] if channel in started else [["sync", collective]]
        if channel in started:  # a continuation: computes while the started one runs
            return [["op", flops, moved]]
        return [["overlap", flops, moved, collective]]

    def dcn_collective(self, instr: Instruction, comp: Computation) -> dict[str, Any]:
        """A cross-slice transfer as a collective over the slices (one chip in each)."""
        kind = _MEGASCALE_RE.search(instr.attrs).group(1).lower().replace("_", "-")
        slices = len({c[-1] for c in self.coords}) if self.coords else 2
        payload = shape_bytes(comp.shapes.get(instr.operands[0], "")) if instr.operands else 0.0
        return dataclasses.asdict(Collective(kind, payload, slices, 0, slices))

    def events(self, comp: Computation) -> list[list[Any]]:
        out: list[list[Any]] = []
        started: set[str] = set()
        for instr in comp.instructions:
            op = instr.opcode
            base = op.removesuffix("-start").removesuffix("-done")
            if op in _FREE_OPS:
                continue
            if op == "while":
                called = dict((r, c) for r, c in hlo.callees(instr))
                trips = hlo.trip_count(instr, comp, self.comps)
                out.append(["loop", called["body"], trips if trips is not None else 1.0])
            elif op == "call":
                out += [["call", c] for r, c in hlo.callees(instr) if r in ("to_apply", "calls")]
            elif op == "conditional":
                out.append(["branches", [c for r, c in hlo.callees(instr) if r == "branch"]])
            elif base in COLLECTIVES and op.endswith("-start"):
                out.append(["start", instr.name,
                            _collective(instr, comp, self.num_devices, self.coords)])
            elif base in COLLECTIVES and op.endswith("-done"):
                out.append(["done", instr.operands[0] if instr.operands else ""])
            elif op in COLLECTIVES:
                out.append(["sync", _collective(instr, comp, self.num_devices, self.coords)])
            elif op == "send" and _MEGASCALE_RE.search(instr.attrs):
                out.append(["start", instr.name, self.dcn_collective(instr, comp)])
            elif op == "recv":  # its data is the send's transfer, counted there
                continue
            elif op in _DMA_STARTS:  # an asynchronous copy: reads its operand, writes it
                out.append(["dma", instr.name, 2.0 * sum(
                    shape_bytes(comp.shapes.get(o, "")) for o in instr.operands)])
            elif op.endswith("-done"):
                out.append(["done", instr.operands[0] if instr.operands else ""])
            elif op == "fusion":
                out += self.fusion(instr, comp, started)
            else:
                kernel = costs.kernel_cost(instr, comp)
                flops, moved = kernel or (costs.matmul_flops(instr, comp.shapes),
                                          costs.op_bytes(instr, comp, self.comps))
                out.append(["op", flops, moved])
        return out


def profile(text: str, num_devices: int, coords: Sequence[Sequence[int]] | None = None
            ) -> StepProfile:
    """The schedule of a compiled step's HLO text. coords[i] = (x, y, z, slice) of logical
    device i (the mesh's devices in order), for the ICI axes and slices a group spans."""
    comps = hlo.parse(text)
    entry = next(c for c in comps.values() if c.is_entry)
    reader = _Reader(comps, num_devices, coords)
    programs: dict[str, list] = {}
    todo = [entry.name]
    while todo:
        name = todo.pop()
        if name in programs or name not in comps:
            continue
        programs[name] = reader.events(comps[name])
        for event in programs[name]:
            if event[0] in ("loop", "call"):
                todo.append(event[1])
            elif event[0] == "branches":
                todo += event[1]
    return with_totals(StepProfile(entry.name, programs))


def with_totals(p: StepProfile) -> StepProfile:
    """The profile with its per-step FLOPs, bytes and collectives summed over the schedule
    (loop bodies times their trip counts; every branch of a conditional, an upper bound)."""
    p.flops, p.hbm_bytes, p.collectives = 0.0, 0.0, []

    def walk(name: str, times: float) -> None:
        for event in p.programs.get(name, []):
            kind = event[0]
            if kind in ("op", "overlap"):
                p.flops += event[1] * times
                p.hbm_bytes += event[2] * times
            if kind in ("sync", "start", "overlap"):
                p.collectives.append(Collective(**{**event[-1], "count": times}))
            if kind == "loop":
                walk(event[1], times * event[2])
            elif kind == "call":
                walk(event[1], times)
            elif kind == "branches":
                for branch in event[1]:
                    walk(branch, times)

    walk(p.entry, 1.0)
    return p
