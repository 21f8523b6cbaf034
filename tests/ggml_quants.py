"""ggml's own quantisers, called in llama.cpp's shared library (`llama-cpp-python`'s libggml-base, the full tier's):
`ggml_quantize_chunk` with no importance matrix, which `llama-quantize` runs on every tensor. And the rows the
everyday tier's stored copy of their bytes (tests/data/ggml_kquants.npz) was made from."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

GGML_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
STORED = Path(__file__).parent / "data" / "ggml_kquants.npz"


def sample_rows() -> np.ndarray:
    """[8, 512] float32: weights of three scales and shapes, and the edge cases of ggml's branches (an all-zero row,
    a positive one (min clamped to 0), integers (ties), a zero sub-block beside a spike, near-underflow values)."""
    rng = np.random.default_rng(53)
    rows = [rng.standard_normal(512) * 0.02, rng.standard_normal(512) ** 3, np.abs(rng.standard_normal(512)),
            np.zeros(512), np.round(rng.standard_normal(512) * 4), rng.standard_normal(512) * 1e-20]
    spike = rng.standard_normal(512)
    spike[:64], spike[100:140] = 0, 5
    constant = np.full(512, 0.25)
    return np.stack(rows + [spike, constant]).astype(np.float32)


def ggml_quantize(rows_RxN: np.ndarray, kind: str) -> np.ndarray:
    """ggml's bytes of `rows_RxN` as `kind` -> uint8 [R, row bytes]."""
    import gguf
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    x = np.ascontiguousarray(rows_RxN, np.float32)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
    written = lib.ggml_quantize_chunk(GGML_TYPES[kind], x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                      None)
    assert written == out.size
    return out
