"""safetensors files read by slices and written tensor by tensor, so neither ever holds a whole model:
`CheckpointReader(directory).read(name, index)`, `write_safetensors`, `write_weights` (sharded, with an index).

Format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to a multiple of 8, then the
C-contiguous little-endian data. Reading uses positioned reads (`os.pread`), not a memory map, whose touched pages
would stay resident: a slice reads only its bytes (one read for whole trailing rows, one per row otherwise), and
`bytes_read` counts them, so a caller can check that a process read only its part. A model in a bucket
(`io.storage.local_model_dir`) is read by ranged requests, one a slice (the span of its rows).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io import storage
from jaxtune.paths import check_room, writing

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                      "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}  # the header's dtype name -> numpy's
SAFETENSORS_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}


def _header(path: Path | str, size: int, read) -> tuple[dict, int]:
    """(tensor name -> (dtype, shape, begin, end) in file offsets, metadata)."""
    raw = read(8, 0)
    if len(raw) < 8:
        raise JaxtuneError(f"{path}: not a readable safetensors file (only {size} bytes)")
    n = struct.unpack("<Q", raw)[0]
    if n + 8 > size:
        raise JaxtuneError(f"{path}: not a readable safetensors file (header length {n} exceeds the file's "
                           f"{size} bytes)")
    try:
        header = json.loads(read(n, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JaxtuneError(f"{path}: not a readable safetensors file (invalid header: {e})") from None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in SAFETENSORS_DTYPES:
            raise JaxtuneError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}, which jaxtune cannot read")
        dtype, shape = np.dtype(SAFETENSORS_DTYPES[info["dtype"]]), tuple(info["shape"])
        begin, end = (8 + n + o for o in info["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or end > size:
            raise JaxtuneError(f"{path}: tensor {name}'s data ends at byte {end}, the file has {size} (truncated?)")
        tensors[name] = (dtype, shape, begin)
    return tensors, header.get("__metadata__", {})


class CheckpointReader:
    """The tensors of a model directory (`model.safetensors`, or shards listed in `model.safetensors.index.json`),
    read whole or by slices. Only the headers are read on opening. Use as a context manager (or `close()`).
    `bytes_read`: this reader's tensor bytes read; `CheckpointReader.total_bytes_read`: every reader's in this
    process (what a process of a multi-process run read of a checkpoint)."""

    total_bytes_read = 0

    def __init__(self, directory: str | Path, rename: Callable[[str], str] | None = None):
        """rename(stored name) -> the name this reader shows (an old layout's names as the current ones); errors
        name the tensor as stored (`stored_name`)."""
        directory = Path(directory)
        bucket = storage.remote_of(directory)  # a model in a bucket: its weights read there by range, never copied
        if (directory / INDEX_FILE).is_file():
            try:
                files = sorted(set(json.loads((directory / INDEX_FILE).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise JaxtuneError(f"{directory / INDEX_FILE}: not a weight index ({type(e).__name__}: {e})") from None
        elif (directory / SINGLE_FILE).is_file() or (bucket and storage.exists(storage.join(bucket, SINGLE_FILE))):
            files = [SINGLE_FILE]
        else:
            found = ", ".join(sorted(p.name for p in directory.iterdir())) if directory.is_dir() else "no directory"
            raise JaxtuneError(f"{bucket or directory}: no {SINGLE_FILE} or {INDEX_FILE} (found: {found or 'nothing'})")
        self.bytes_read = 0
        self._fds: list[int] = []
        self._tensors: dict[str, tuple] = {}
        for name in files:
            path = directory / name
            if bucket:
                url = storage.join(bucket, name)
                if not storage.exists(url):
                    raise JaxtuneError(f"{url}: file not found (listed in {INDEX_FILE})")
                read, size, where = (lambda k, at, url=url: storage.read_range(url, at, k)), storage.size(url), url
            elif path.is_file():
                fd = os.open(path, os.O_RDONLY)
                self._fds.append(fd)
                read, size, where = (lambda k, at, fd=fd: os.pread(fd, k, at)), os.fstat(fd).st_size, path
            else:
                raise JaxtuneError(f"{path}: file not found (listed in {INDEX_FILE})")
            tensors, _ = _header(where, size, read)
            self._tensors.update({(rename or str)(t): (*info, read, where, t, bool(bucket))
                                  for t, info in tensors.items()})

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def stored_name(self, name: str) -> str:
        return self._info(name)[5]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._info(name)[0]

    def stored_type(self, name: str) -> str:
        """The dtype as safetensors names it (F32, BF16, ...)."""
        return SAFETENSORS_NAMES[self.dtype(name)]

    def stored_bytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.dtype(name).itemsize

    def file_of(self, name: str) -> Path | str:
        """The file (or the URL of a model in a bucket) holding tensor `name`."""
        return self._info(name)[4]

    def _info(self, name: str) -> tuple:
        if name not in self._tensors:
            raise JaxtuneError(f"tensor {name} is not in the checkpoint")
        return self._tensors[name]

    def _pread(self, read: Callable[[int, int], bytes], size: int, at: int, path: Path | str) -> bytes:
        data = read(size, at)
        if len(data) != size:
            raise JaxtuneError(f"{path}: truncated: {size} bytes at {at} asked, {len(data)} read")
        self.bytes_read += size
        CheckpointReader.total_bytes_read += size
        return data

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """`tensor[index]` (slices of step 1, one per leading dimension; missing ones take everything)."""
        dtype, shape, begin, source, path, _, bucket = self._info(name)
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
        out_shape = tuple(max(0, b - a) for a, b in bounds)
        out = np.empty(out_shape, dtype)
        if out.size == 0:
            return out
        # dims k.. are read whole, so dim k-1's range and everything after it is one contiguous run per index of
        # the dims before it
        k = len(shape)
        while k > 0 and bounds[k - 1] == (0, shape[k - 1]):
            k -= 1
        lead = max(k - 1, 0)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        run = math.prod(out_shape[lead:])
        flat = out.reshape(-1)
        firsts = [sum((bounds[d][0] + start[d]) * strides[d] for d in range(len(start)))
                  + sum(bounds[d][0] * strides[d] for d in range(len(start), len(shape)))
                  for start in np.ndindex(*out_shape[:lead])]
        if bucket and len(firsts) > 1:  # a request's latency, not its bytes, is a bucket's cost: one for the span
            span = np.frombuffer(self._pread(source, (firsts[-1] + run - firsts[0]) * dtype.itemsize,
                                             begin + firsts[0] * dtype.itemsize, path), dtype)
            for i, first in enumerate(firsts):
                flat[i * run:(i + 1) * run] = span[first - firsts[0]:first - firsts[0] + run]
            return out
        for i, first in enumerate(firsts):
            data = self._pread(source, run * dtype.itemsize, begin + first * dtype.itemsize, path)
            flat[i * run:(i + 1) * run] = np.frombuffer(data, dtype)
        return out


def write_safetensors(path: str | Path, entries: Iterable[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write `entries` (name, shape, dtype, produce) in order; each `produce()` is called once, when its bytes are
    written, so at most one tensor is held at a time."""
    entries = list(entries)
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with writing(path, 8 + len(text) + offset), open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype, produce in entries:
            value = np.asarray(produce(), order="C")
            if value.shape != tuple(shape) or value.dtype != np.dtype(dtype):
                raise ValueError(f"tensor {name}: produced {value.dtype}{list(value.shape)}, declared "
                                 f"{np.dtype(dtype)}{list(shape)}")
            f.write(value.tobytes())


def write_weights(directory: str | Path, entries: list[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]],
                  max_shard_bytes: int = 2 * 2**30, metadata: dict[str, str] | None = None) -> None:
    """A model directory's weights: `model.safetensors`, or shards of at most `max_shard_bytes` (a bigger tensor
    alone) with `model.safetensors.index.json`, as transformers' `save_pretrained` names them; stale weight files
    of the other layout are removed."""
    directory = Path(directory)
    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    check_room(directory / SINGLE_FILE, sum(math.prod(e[1]) * np.dtype(e[2]).itemsize for e in entries))
    shards: list[list[tuple]] = []
    current: list[tuple] = []
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * np.dtype(entry[2]).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    shards.append(current)
    metadata = {"format": "pt"} if metadata is None else metadata
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0], metadata)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / name, shard, metadata)
        weight_map.update({e[0]: name for e in shard})
        total += sum(math.prod(e[1]) * np.dtype(e[2]).itemsize for e in shard)
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n")
