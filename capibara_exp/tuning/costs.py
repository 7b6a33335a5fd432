"""What one HLO instruction costs on a device: matmul FLOPs, HBM bytes, collective groups,
and the Pallas TPU kernels the planner knows.

- Matmul FLOPs: `dot` and `convolution` ops (TPU lowers einsums to convolutions, batch
  dimensions to base-dilated windows).
- HBM bytes of a top-level op: a fusion reads its operands (only the slices it takes of
  them) and writes its result once; ops inside a fusion stay in on-chip memory.
- Collective groups: the logical devices of one replica group, from any of XLA's
  spellings, and with the devices' physical coordinates, how many ICI axes and how many
  slices (DCN) a group spans.
- Pallas kernels are opaque custom calls to XLA; the splash-attention kernels
  (nets/attention.py) are counted from their operand shapes and block sizes: causal
  attention visits the key blocks at or before each query block.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from capibara_exp.tuning import hlo
from capibara_exp.tuning.hlo import Computation, Instruction, dims_of, shape_bytes


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


def group_members(attrs: str, num_devices: int) -> list[int]:
    """Logical device ids (positions in the compiled device assignment, i.e. the mesh's
    devices in order) of a collective's first replica group, from any of XLA's spellings."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
        sizes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        grouped = set(re.findall(r"'([^']+)'", mesh.group(2)))
        ids = np.arange(math.prod(n for _, n in sizes)).reshape([n for _, n in sizes])
        first = tuple(slice(None) if a in grouped else 0 for a, _ in sizes)
        return [int(i) for i in ids[first].ravel()]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return [int(i) for i in ids.reshape(int(iota.group(1)), int(iota.group(2)))[0]]
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        return [int(d) for d in listed.group(1).split(",") if d]
    pair = re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", attrs)
    if pair:
        return [int(pair.group(1)), int(pair.group(2))]
    return list(range(num_devices))  # replica_groups={}: every device


def span(members: Sequence[int], coords: Sequence[Sequence[int]] | None) -> tuple[int, int]:
    """(ICI axes, slices) a group spans: physical axes along which its members' coordinates
    differ, and distinct slices among them. coords[i] = (x, y, z, slice) of logical device i;
    without coordinates (host devices), one axis and one slice."""
    if not coords or len(members) < 2:
        return (1 if len(members) > 1 else 0), 1
    points = np.asarray([coords[m] for m in members])
    axes = sum(len(set(points[:, a])) > 1 for a in range(points.shape[1] - 1))
    return max(int(axes), 1), len(set(points[:, -1]))


_BLOCK_RE = r'\\?"{}\\?"\s*:\s*(\d+)'
SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}  # q k^T and p v; + dp, dq; + dp, dv, dk
_SPLASH_BLOCKS = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq"),
                  "dkv": ("block_q_dkv", "block_kv_dkv")}


def causal_block_fraction(length: int, block_q: int, block_kv: int) -> float:
    """Share of (query block, key block) pairs a causal kernel computes: the key blocks
    that start at or before the query block's last position."""
    n_q, n_kv = -(-length // block_q), -(-length // block_kv)
    visited = sum(min(n_kv, ((i + 1) * block_q - 1) // block_kv + 1) for i in range(n_q))
    return visited / (n_q * n_kv)


def kernel_cost(instr: Instruction, comp: Computation) -> tuple[float, float] | None:
    """(FLOPs, HBM bytes) of a Pallas TPU kernel (a `tpu_custom_call`); None for other ops.
    Splash kernels get their matmul FLOPs; any other kernel only its operand and result bytes."""
    if instr.opcode != "custom-call" or "tpu_custom_call" not in instr.attrs:
        return None
    moved = sum(shape_bytes(comp.shapes.get(o, "")) for o in instr.operands) + instr.result_bytes
    kind = re.search(r"splash_mh?q?a_(fwd|dq|dkv)", instr.name + " " + instr.attrs)
    qkv = [dims_of(comp.shapes.get(o, "")) for o in instr.operands]
    qkv = [d for d in qkv if len(d) == 4]
    if not kind or not qkv:
        return 0.0, moved
    batch, heads, length, head_dim = qkv[0]
    names = _SPLASH_BLOCKS[kind.group(1)]
    blocks = [re.search(_BLOCK_RE.format(n), instr.attrs) for n in names]
    bq, bkv = (int(b.group(1)) if b else min(512, length) for b in blocks)
    matmuls = SPLASH_MATMULS[kind.group(1)]
    flops = (2.0 * matmuls * batch * heads * length * length * head_dim
             * causal_block_fraction(length, bq, bkv))
    return flops, moved


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


def op_bytes(instr: Instruction, comp: Computation, comps: dict[str, Computation]) -> float:
    """HBM bytes of one top-level op: what it reads of its operands plus what it writes."""
    if instr.opcode in _SLICES:
        return 2.0 * instr.result_bytes
    if instr.opcode == "dynamic-update-slice":
        return 2.0 * _written_bytes(instr, comp)
    callee = next((c for r, c in hlo.callees(instr) if r == "calls"), None)
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
