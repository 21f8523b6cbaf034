"""MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 E2M1 values (4 bits: sign, 2 exponent bits, 1 mantissa
bit) sharing one E8M0 scale, a power of two 2**(s - 127). gpt-oss releases its experts so: `*_blocks` [..., G, 16]
uint8 (two values a byte, the low nibble first) and `*_scales` [..., G] uint8, G blocks of 32 along the input.

`decode_mxfp4` is transformers' `convert_moe_packed_tensors` before its final transpose, bit for bit; `encode_mxfp4`
a nearest-value quantiser (each block's scale the least power of two that brings its largest magnitude within 6,
so nothing saturates), for tests and exports.
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)  # a nibble's value


def decode_mxfp4(blocks_xGx16: np.ndarray, scales_xG: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Values [..., G * 32] in `dtype` of MXFP4 blocks [..., G, 16] uint8 and scales [..., G] uint8."""
    values = np.empty(blocks_xGx16.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = E2M1[blocks_xGx16 & 0x0F]
    values[..., 1::2] = E2M1[blocks_xGx16 >> 4]
    # times 2**(scale - 127), exact in float32 for any scale a block of E2M1 values and a float32 result can hold
    values = np.ldexp(values, scales_xG.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks_xGx16.shape[:-2], -1).astype(dtype)


def encode_mxfp4(values_xN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks [..., N/32, 16] uint8, scales [..., N/32] uint8) nearest to float values [..., N] (N a multiple of
    32): each block scaled by 2**ceil(log2(max |x| / 6)), then each value rounded to the nearest E2M1 value."""
    x = np.asarray(values_xN, np.float32).reshape(*values_xN.shape[:-1], -1, 32)
    largest = np.max(np.abs(x), axis=-1)
    exponent = np.where(largest > 0, np.ceil(np.log2(np.where(largest > 0, largest, 1) / 6)), -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = x / np.ldexp(np.float32(1), exponent)[..., None]
    nibbles = np.argmin(np.abs(scaled[..., None] - E2M1), axis=-1).astype(np.uint8)  # -0 never wins: ties go first
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    # contiguous: safetensors' numpy writer stores a strided array's buffer as it lies
    return np.ascontiguousarray(blocks), np.ascontiguousarray(exponent + 127, np.uint8)
