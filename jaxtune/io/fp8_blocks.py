"""Block-scaled FP8 checkpoints (DeepSeek-V3 and Kimi K2 as released: `quantization_config` with quant_method "fp8"):
each linear weight float8_e4m3fn [out, in] beside its `weight_scale_inv` [ceil(out / b0), ceil(in / b1)] float32, one
scale a block of `weight_block_size` b0 x b1. `BlockFP8Reader` shows such a checkpoint as the float one it stands
for: a weight (whole or a slice of it) is decoded where it is read, w = fp8 * its block's scale in float32, as
transformers dequantises it, so no float copy of the model exists beside the one being loaded.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json

SCALE_SUFFIX = "_scale_inv"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_block_size(directory: Path) -> tuple[int, int] | None:
    """`weight_block_size` of the directory's config.json when its weights are block-scaled FP8, else None."""
    config = directory / "config.json"
    quantization = (read_json(config).get("quantization_config") or {}) if config.is_file() else {}
    if quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size") or (128, 128)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise JaxtuneError(f"{config}: quantization_config.weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


class BlockFP8Reader:
    """A checkpoint reader (`io.safetensors.CheckpointReader`'s interface) whose FP8 weights read as float32 and
    whose scales are not tensors of their own."""

    def __init__(self, reader, block: tuple[int, int]):
        self._reader, self._block = reader, block
        self._scaled = {name[:-len(SCALE_SUFFIX)] for name in reader.names() if name.endswith(SCALE_SUFFIX)}
        for name in self._scaled:
            if name not in reader or reader.dtype(name) != FP8 or len(reader.shape(name)) != 2:
                raise JaxtuneError(f"tensor {reader.stored_name(name + SCALE_SUFFIX)}: scales no 2-D float8_e4m3fn "
                                   "weight")
            want = tuple(-(-n // b) for n, b in zip(reader.shape(name), block))
            if reader.shape(name + SCALE_SUFFIX) != want:
                raise JaxtuneError(f"tensor {reader.stored_name(name + SCALE_SUFFIX)} has shape "
                                   f"{reader.shape(name + SCALE_SUFFIX)}, expected {want} (blocks of {block})")

    def __getattr__(self, attribute):  # shape, stored_name, file_of, close, bytes_read, ...
        return getattr(self._reader, attribute)

    def __enter__(self) -> BlockFP8Reader:
        return self

    def __exit__(self, *_) -> None:
        self._reader.close()

    def names(self) -> list[str]:
        return [name for name in self._reader.names() if not name.endswith(SCALE_SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self._reader and not name.endswith(SCALE_SUFFIX)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self._scaled else self._reader.dtype(name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """`tensor[index]`, an FP8 weight's decoded: its values times their blocks' scales, in float32."""
        if name not in self._scaled:
            return self._reader.read(name, index)
        shape = self._reader.shape(name)
        index = tuple(index or ()) + (slice(None),) * (2 - len(index or ()))
        (r0, r1), (c0, c1) = (s.indices(n)[:2] for s, n in zip(index, shape))
        (b0, b1) = self._block
        scales = self._reader.read(name + SCALE_SUFFIX, (slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1))))
        rows: np.ndarray = np.arange(r0, r1) // b0 - r0 // b0
        cols: np.ndarray = np.arange(c0, c1) // b1 - c0 // b1
        values = self._reader.read(name, (slice(r0, r1), slice(c0, c1))).astype(np.float32)
        return values * scales.astype(np.float32)[rows][:, cols]
