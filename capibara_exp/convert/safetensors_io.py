"""The safetensors format, read and written a tensor at a time.

A file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets: [begin, end]}} and an optional "__metadata__" of strings) and the tensors'
bytes, little-endian and row-major. A sharded model lists its files in
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {name: file}}).

Reading reads each tensor when it is used: one read of its bytes into a new array, or a
read-only view of the file's pages (`mapped`, for the import, which transposes and writes
from it) mapped only while the tensor is in use. Nothing else is held. Writing computes
the header from the shapes first, then streams each tensor's bytes in order: host memory
is one tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from capibara_exp.base.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
FLOATS = {np.dtype(DTYPES[k]) for k in ("F64", "F32", "F16", "BF16")}
_MAX_HEADER = 100 * 2**20  # the format's own limit on a header's size


def dtype_code(dtype: np.dtype) -> str:
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        raise ConfigError(f"dtype {dtype} has no safetensors code") from None


class SafetensorsFile:
    """One .safetensors file: its tensors' names, shapes and dtypes, read lazily."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if not 0 < length <= _MAX_HEADER:
                    raise ValueError(f"header length {length}")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as err:
            raise ConfigError(f"{path}: not a safetensors file ({err})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self._start = 8 + length
        self._size = path.stat().st_size

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self.entries[name]["dtype"]
        if code not in DTYPES:
            raise ConfigError(f"{self.path}: tensor {name} has dtype {code}, which this "
                              f"converter does not read ({', '.join(DTYPES)})")
        return np.dtype(DTYPES[code])

    def tensor(self, name: str) -> np.ndarray:
        """The tensor, read from the file into a new array."""
        begin, end = self._span(name)
        raw = np.fromfile(self.path, np.uint8, count=end - begin, offset=self._start + begin)
        return raw.view(self.dtype(name)).reshape(self.shape(name))

    def mapped(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file's pages (mapped until the array is
        dropped): what is made from it (a transpose, a write) reads the page cache itself,
        without first copying the bytes into a new array."""
        begin, end = self._span(name)
        if end == begin:
            return self.tensor(name)
        raw = np.memmap(self.path, np.uint8, mode="r", offset=self._start + begin,
                        shape=(end - begin,))
        return raw.view(self.dtype(name)).reshape(self.shape(name))

    def _span(self, name: str) -> tuple[int, int]:
        begin, end = self.entries[name]["data_offsets"]
        dtype, shape = self.dtype(name), self.shape(name)
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected or self._start + end > self._size:
            raise ConfigError(f"{self.path}: tensor {name} has {end - begin} bytes for shape "
                              f"{list(shape)} {dtype} ({expected} expected), or the file is cut")
        return begin, end


class Checkpoint:
    """The tensors of a model directory: one file or the shards its index lists."""

    def __init__(self, directory: Path):
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"{index}: not a safetensors index ({err})") from None
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE).is_file():
            files, weight_map = [SINGLE], None
        else:
            raise ConfigError(f"{directory}: no {SINGLE} nor {INDEX} (a Hugging Face model "
                              "directory with safetensors weights)")
        self.files = {f: SafetensorsFile(directory / f) for f in files}
        self.where: dict[str, SafetensorsFile] = {}
        for name, file in (weight_map or {n: SINGLE for n in self.files[SINGLE].names()}).items():
            if file not in self.files:
                raise ConfigError(f"{index}: {name} is in {file}, which does not exist")
            if name not in self.files[file].entries:
                raise ConfigError(f"{directory / file}: has no tensor {name} (the index "
                                  "says it does)")
            self.where[name] = self.files[file]

    def names(self) -> list[str]:
        return list(self.where)

    def tensor(self, name: str) -> np.ndarray:
        return self.where[name].tensor(name)

    def mapped(self, name: str) -> np.ndarray:
        return self.where[name].mapped(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.where[name].dtype(name)


def transposed(x: np.ndarray, tile: int = 128) -> np.ndarray:
    """x.T as a new contiguous array. numpy's strided copy of a large 2-D transpose costs per
    element, not per byte, and runs far below the memory bandwidth; so the matrix is moved as
    16-byte words (eight bfloat16 side by side), a band of word-columns at a time in tiles
    that stay in cache, and each band's words are then split into their lanes' rows (a band
    of transposed words is (band, R, k) lanes; its rows of the result are (band, k, R)).
    2-4x faster than tiles of single elements; beside x and the result, one band is held."""
    if x.ndim != 2 or not x.size:
        return np.ascontiguousarray(x.T)
    x = np.ascontiguousarray(x)
    rows, cols = x.shape
    uint = _UINTS.get(x.dtype.itemsize)
    fits = [(size // x.dtype.itemsize, word) for size, word in _WORDS
            if uint and size // x.dtype.itemsize >= 2 and cols % (size // x.dtype.itemsize) == 0]
    if not fits:
        out = np.empty((cols, rows), x.dtype)
        _tiled(x.view(uint or x.dtype), out.view(uint or x.dtype), tile)
        return out
    lanes, word = fits[0]
    words = x.view(word)  # (moving bytes only: a NaN's bits are kept as they are)
    out = np.empty((cols // lanes, lanes, rows), uint)
    band = np.empty((min(tile, words.shape[1]), rows), word)
    for j in range(0, words.shape[1], tile):
        part = band[:min(tile, words.shape[1] - j)]
        _tiled(words[:, j:j + tile], part, tile)
        out[j:j + tile] = part.view(uint).reshape(-1, rows, lanes).transpose(0, 2, 1)
    return out.reshape(cols, rows).view(x.dtype)


def _tiled(x: np.ndarray, out: np.ndarray, tile: int) -> None:
    """out[...] = x.T, tile by tile."""
    for i in range(0, x.shape[0], tile):
        for j in range(0, x.shape[1], tile):
            out[j:j + tile, i:i + tile] = x[i:i + tile, j:j + tile].T


_WORDS = ((16, np.complex128), (8, np.uint64))  # numpy copies either as one unit
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# A tensor to write: its name, shape, dtype and a function giving its values when written.
Planned = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]


def shards(planned: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Tensors split into files of at most max_bytes (a larger tensor gets a file alone)."""
    out: list[list[Planned]] = [[]]
    size = 0
    for item in planned:
        nbytes = int(np.prod(item[1], dtype=np.int64)) * np.dtype(item[2]).itemsize
        if out[-1] and size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


def write_file(path: Path, planned: Iterable[Planned], metadata: dict[str, str] | None = None
               ) -> Iterator[tuple[str, int]]:
    """Write one .safetensors file, a tensor at a time; yields (name, bytes) as each is
    written (for progress)."""
    planned = list(planned)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype, _ in planned:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for (name, _, _, _), array in zip(planned, _made(planned), strict=True):
            f.write(array.reshape(-1).view(np.uint8).data)  # (bfloat16 has no buffer format)
            yield name, array.nbytes


def _made(planned: list[Planned]) -> Iterator[np.ndarray]:
    """Each planned tensor's values, in order, the next one made on a thread while the caller
    writes this one (reading, transposing and writing overlap; two tensors are held)."""
    def make(item: Planned) -> np.ndarray:
        name, shape, dtype, values = item
        array = np.ascontiguousarray(values(), dtype=dtype)
        if array.shape != tuple(shape):
            raise ValueError(f"{name}: planned shape {shape}, got {array.shape}")
        return array

    with ThreadPoolExecutor(1, thread_name_prefix="make") as pool:
        coming = pool.submit(make, planned[0]) if planned else None
        for item in planned[1:]:
            array = coming.result()
            coming = pool.submit(make, item)
            yield array
        if coming is not None:
            yield coming.result()


def write_index(directory: Path, files: dict[str, list[Planned]], total_size: int) -> None:
    weight_map = {item[0]: name for name, items in files.items() for item in items}
    (directory / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n")
