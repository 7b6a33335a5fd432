"""A T5X-layout checkpoint written from arrays made one at a time: fast, in bounded memory.

The checkpoint is the one runtime/checkpoints.py and T5X write: an Orbax CheckpointManager
step dir checkpoint_<step>/state, PyTreeCheckpointHandler with OCDBT, each array a zarr
array of one uncompressed chunk (a converted model is written once and read by every run).
The arrays' handler is Orbax's NumpyHandler (its typestr, its tensorstore spec through
`get_json_tspec_write`), so Orbax and T5X restore them with their own handler; only its
public `serialize` differs: it takes leaves that make their array when asked.

Arrays are made on a few threads (read from the safetensors, transposed, checked for
NaN/Inf) while tensorstore writes those made before, every write in flight at once (OCDBT
commits them together): reading, transposing and writing overlap. The bytes made and not
yet written are bounded by `budget` (a larger array goes alone), so host memory is the
budget plus the arrays being made, whatever the size of the model.

The kernels are transposed here (safetensors_io.transposed) and stored row-major, as Orbax
stores them. zarr's column-major order ("order": "F") would store PyTorch's [out, in] bytes
as they are and make the import's transposes free, and Orbax and T5X would restore it; but
tensorstore reads such a chunk into the row-major arrays a restore asks for 9-17x slower
than a row-major one (bench/convert.py: 5.1 s against 0.30 s for a 0.9 GB model's kernels,
five times the import's own transposes), so every run restoring it would pay more, each time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from capibara_exp.runtime import checkpoints, integrity


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A checkpoint array known by shape and dtype now, made by `make()` when written."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]
    name: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def load(self) -> np.ndarray:
        array = np.ascontiguousarray(self.make(), dtype=self.dtype)
        if array.shape != tuple(self.shape):
            raise checkpoints.CheckpointError(f"{self.name}: made shape {array.shape}, "
                                              f"planned {self.shape}")
        if not finite(array):
            raise checkpoints.NonFiniteState(f"{self.name} holds NaN/Inf (nothing written)")
        return array


# IEEE formats (bfloat16 too) by size: the bits below the sign, and the exponent's. A value
# is Inf or NaN when its exponent is all ones, i.e. when bits & magnitude >= exponent.
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FORMATS = {np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00)}
_IEEE = {2: (np.uint16, 0x7FFF, 0x7F80), 4: (np.uint32, 0x7FFFFFFF, 0x7F800000),
         8: (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


def finite(array: np.ndarray, block: int = 1 << 16) -> bool:
    """Whether a host array holds no NaN/Inf, from its bits, a cache-sized block at a time
    (one masked copy and one max per block: no array-sized temporaries); non-float arrays
    are finite."""
    if array.dtype.kind != "f" and array.dtype != _BFLOAT16:
        return True
    uint, magnitude, exponent = _FORMATS.get(array.dtype) or _IEEE[array.dtype.itemsize]
    bits = array.reshape(-1).view(uint)
    buf = np.empty(min(block, bits.size), uint)
    for i in range(0, bits.size, block):
        part = buf[:min(block, bits.size - i)]
        np.bitwise_and(bits[i:i + block], uint(magnitude), out=part)
        if part.max() >= exponent:
            return False
    return True


class _Budget:
    """Bytes made and not yet written: `take` waits until n more fit (or nothing is held)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.held or self.held + n <= self.limit)
            self.held += n

    async def give(self, n: int) -> None:
        async with self._changed:
            self.held -= n
            self._changed.notify_all()


class LeafHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's NumpyHandler for Leaf values: each made on `workers` threads when its turn
    comes, written by tensorstore with the spec Orbax gives a numpy array of its shape."""

    def __init__(self, budget: int, workers: int):
        super().__init__(deepcopy_host_arrays=False)
        self.budget, self.workers = budget, workers

    async def serialize(self, values: Sequence[Leaf], infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> list:
        args = args or [ocp.SaveArgs()] * len(values)
        return [ocp.future.CommitFutureAwaitingContractedSignals(
            self._write_all(list(values), list(infos), list(args)), name="leaf_writer")]

    async def _write_all(self, leaves: list[Leaf], infos: list, args: list) -> None:
        budget = _Budget(self.budget)
        with ThreadPoolExecutor(self.workers, thread_name_prefix="leaf") as pool:
            tasks: list[asyncio.Future] = []
            for leaf, info, arg in zip(leaves, infos, args, strict=True):
                await budget.take(leaf.nbytes)  # in order: the files are read in order
                if any(t.done() and t.exception() for t in tasks):
                    break  # one failed: start no more
                tasks.append(asyncio.ensure_future(self._write(leaf, info, arg, pool, budget)))
            # Every write started ends before the failure is raised: a write still in flight
            # would otherwise put files back into the directory the caller then removes.
            done = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def _write(self, leaf: Leaf, info: Any, arg: Any, pool: ThreadPoolExecutor,
                     budget: _Budget) -> None:
        try:
            await info.await_path_creation()
            array = await asyncio.get_running_loop().run_in_executor(pool, leaf.load)
            spec = ocp.type_handlers.get_json_tspec_write(
                info, use_ocdbt=bool(info.is_ocdbt_checkpoint), global_shape=array.shape,
                local_shape=array.shape, dtype=array.dtype, process_index=jax.process_index(),
                arg=arg)
            if jax.process_index() == 0:
                store = await ts.open(ts.Spec(spec), create=True, open=True,
                                      context=info.ts_context)
                await store.write(array, can_reference_source_data_indefinitely=True)
        finally:
            await budget.give(leaf.nbytes)


def largest(tree: Any) -> int:
    return max((leaf.nbytes for leaf in jax.tree.leaves(tree) if isinstance(leaf, Leaf)),
               default=0)


def save(model_dir: str | Path, step: int, tree: Any, kind: str, budget: int | None = None,
         workers: int | None = None) -> Path:
    """Write checkpoint_<step> of `tree` (Leaf values and small host arrays) in T5X's layout,
    with its integrity manifest. `budget` (bytes made and not yet written) defaults to the
    largest leaf, which then goes alone: the writes keep the disk's pace with a few arrays
    waiting, not many. Each leaf refuses NaN/Inf as it is made, so the manifest says the
    state is finite."""
    budget = budget or largest(tree)
    workers = workers or min(4, os.cpu_count() or 1)
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler()), (Leaf, LeafHandler(budget, workers)))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=False,
                                          type_handler_registry=registry)
    options = ocp.CheckpointManagerOptions(step_prefix=checkpoints.STEP_PREFIX, create=True)
    with ocp.CheckpointManager(Path(model_dir).absolute(), options=options,
                               item_handlers={checkpoints.ITEM: handler}) as mgr:
        mgr.save(step, args=ocp.args.Composite(
            **{checkpoints.ITEM: ocp.args.PyTreeSave(tree)}), force=True,
            custom_metadata={checkpoints.KIND_KEY: kind})
        mgr.wait_until_finished()
    path = checkpoints.step_dir(model_dir, step)
    integrity.write_manifest(path, step=step, kind=kind, finite=True)
    return path
