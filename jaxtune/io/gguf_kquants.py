"""llama.cpp's k-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 values) in numpy, bit for bit as ggml's reference
quantisers without an importance matrix write them (`ggml-quants.c`: quantize_row_q{4,5,6}_K_ref, make_qkx2_quants,
make_qx_quants), which is what `llama-quantize` runs. Vectorised over blocks; every float32 sum is accumulated in
ggml's order (one value after the next, no pairwise summation) and every rounding is ggml's `nearest_int` (round half
to even), so the bytes are the same. The 32-value types (Q4_0, Q5_0, Q5_1, Q8_0) are the `gguf` package's.

    quantize_rows(x_RxN, "Q4_K")  # -> uint8 [R, N / 256 * 144]
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_F = np.float32
_CHUNK = 256  # super-blocks quantised together: 256 KB of float32 a chunk, in cache (2x faster than 2048 here)


def _nearest(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even, as int32."""
    return np.rint(x).astype(np.int32)


def _running_sum(terms_NxM: np.ndarray) -> np.ndarray:
    """sum over axis 0 one term after the next in float32 (ggml's loop order) -> [M]."""
    total = terms_NxM[0].copy()
    for term in terms_NxM[1:]:
        total += term
    return total


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> float16 (round to nearest even, as GGML_FP32_TO_FP16) and the value back as float32."""
    half: np.ndarray = x.astype(np.float16)
    return half, half.astype(_F)


def _qkx2(x_NxM: np.ndarray, w_NxM: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants for M sub-blocks of N values (down axis 0): a scale and a min searched over nstep + 1 grids
    for the least weighted squared error -> (scale [M], -min [M], levels [N, M] in 0..nmax)."""
    mn, mx = x_NxM[0].copy(), x_NxM[0].copy()
    for row in x_NxM[1:]:
        np.minimum(mn, row, out=mn)
        np.maximum(mx, row, out=mx)
    sum_w, sum_x = _running_sum(w_NxM), _running_sum(w_NxM * x_NxM)
    mn = np.where(mn > 0, _F(0), mn)
    flat = mx == mn
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = _F(nmax) / (mx - mn)
        scale = _F(1) / iscale
        levels = np.clip(_nearest(iscale * (x_NxM - mn)), 0, nmax)
        diff = scale * levels.astype(_F) + mn - x_NxM
        best = _running_sum(w_NxM * (diff * diff))
        for step in range(nstep + 1):
            iscale = (_F(rmin) + _F(rdelta) * _F(step) + _F(nmax)) / (mx - mn)
            aux = np.clip(_nearest(iscale * (x_NxM - mn)), 0, nmax)
            aux_f = aux.astype(_F)
            wl = w_NxM * aux_f
            sum_l, sum_l2, sum_xl = _running_sum(wl), _running_sum(wl * aux_f), _running_sum(wl * x_NxM)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, _F(0), this_min)
            diff = this_scale * aux_f + this_min - x_NxM
            error = _running_sum(w_NxM * (diff * diff))
            better = (D > 0) & (error < best) & ~flat
            levels = np.where(better, aux, levels)
            best = np.where(better, error, best)
            scale, mn = np.where(better, this_scale, scale), np.where(better, this_min, mn)
    return np.where(flat, _F(0), scale), -mn, np.where(flat, 0, levels)


def _scales_mins_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [B, 8] packed in 12 bytes as ggml's q4_K/q5_K blocks hold them -> uint8 [B, 12]."""
    packed = np.zeros((ls.shape[0], 12), np.uint8)
    packed[:, :4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, :4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return packed


def _q45_k(x_BxK: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shared part of quantize_row_q4_K_ref / q5_K_ref -> (d and dmin as float16 bytes [B, 4], packed scales
    [B, 12], levels [B, 256] in 0..nmax)."""
    B = x_BxK.shape[0]
    x_NxM = np.ascontiguousarray(x_BxK.reshape(B * 8, 32).T)  # each sub-block of 32 down axis 0
    av_x = np.sqrt(_running_sum(x_NxM * x_NxM) / _F(32))
    rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
    scales, mins, levels = _qkx2(x_NxM, av_x + np.abs(x_NxM), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    max_scale, max_min = np.where(max_scale > 0, max_scale, _F(0)), np.where(max_min > 0, max_min, _F(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))[:, None]
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))[:, None]
    ls = np.minimum(_nearest(inv_scale * scales) & 0xFF, 63).astype(np.uint8)  # uint8 as ggml casts it
    lm = np.minimum(_nearest(inv_min * mins) & 0xFF, 63).astype(np.uint8)
    d16, d = _fp16(max_scale / _F(63))
    dmin16, dmin = _fp16(max_min / _F(63))
    d_BxS, dm_BxS = d[:, None] * ls.astype(_F), dmin[:, None] * lm.astype(_F)
    x_BxSx32 = x_BxK.reshape(B, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        fresh = np.clip(_nearest((x_BxSx32 + dm_BxS[..., None]) / d_BxS[..., None]), 0, nmax)
    kept = levels.T.reshape(B, 8, 32)  # a sub-block whose scale rounded to 0 keeps make_qkx2_quants' levels
    levels = np.where(d_BxS[..., None] != 0, fresh, kept).reshape(B, QK_K)
    head = np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8)], axis=1)
    return head, _scales_mins_k4(ls, lm), levels


def _q4_k(x_BxK: np.ndarray) -> np.ndarray:
    head, scales, L = _q45_k(x_BxK, 15)
    L = L.reshape(-1, 4, 2, 32).astype(np.uint8)  # 64 values a row of 32 bytes: low nibble, then high
    return np.concatenate([head, scales, (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def _q5_k(x_BxK: np.ndarray) -> np.ndarray:
    head, scales, L = _q45_k(x_BxK, 31)
    L = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    low = L & 0xF
    high = (L >> 4).reshape(-1, 8, 32)  # the fifth bit of sub-block s at bit s of qh
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, scales, qh, (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def _qx(x_NxM: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants with rmse_type 1 (weights x²) for M sub-blocks of N values -> (scale [M], levels [N, M] in
    0..2 nmax - 1; 0 for an all-zero sub-block)."""
    first = np.argmax(np.abs(x_NxM), axis=0)  # the first of the largest magnitudes, as ggml's strict `>`
    top = np.take_along_axis(x_NxM, first[None], axis=0)[0]
    zero = np.abs(top) < _F(1e-15)
    w = x_NxM * x_NxM
    wx = w * x_NxM

    def sums(iscale):
        levels = np.clip(_nearest(iscale * x_NxM), -nmax, nmax - 1)
        lf = levels.astype(_F)
        return levels, _running_sum(wx * lf), _running_sum(w * lf * lf)

    with np.errstate(divide="ignore", invalid="ignore"):
        levels, sumlx, suml2 = sums(_F(-nmax) / top)
        scale = np.where(suml2 != 0, sumlx / suml2, _F(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            trial, sumlx, suml2 = sums(-(_F(nmax) + _F(0.1) * _F(step)) / top)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            levels = np.where(better, trial, levels)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, _F(0), scale), np.where(zero, 0, levels + nmax)


def _q6_k(x_BxK: np.ndarray) -> np.ndarray:
    B = x_BxK.shape[0]
    scales, levels = _qx(np.ascontiguousarray(x_BxK.reshape(B * 16, 16).T), 32)
    scales = scales.reshape(B, 16)
    first = np.argmax(np.abs(scales), axis=1)
    max_scale = np.take_along_axis(scales, first[:, None], axis=1)[:, 0]
    empty = np.abs(max_scale) < _F(1e-15)  # an all-zero block: every byte 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(empty, _F(0), _F(-128) / max_scale)
        d16, d = _fp16(np.where(empty, _F(0), _F(1) / iscale))
        q_scales = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)
        d_BxS = d[:, None] * q_scales.astype(_F)
        x_BxSx16 = x_BxK.reshape(B, 16, 16)
        fresh = np.clip(_nearest(x_BxSx16 / d_BxS[..., None]), -32, 31) + 32
    kept = levels.T.reshape(B, 16, 16)
    L = np.where(d_BxS[..., None] != 0, fresh, kept).reshape(B, 2, 4, 32).astype(np.uint8)  # 128 values: 4 rows of 32
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(B, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6))
    block = np.concatenate([ql, qh.reshape(B, 64), q_scales.view(np.uint8), d16[:, None].view(np.uint8)], axis=1)
    block[empty] = 0
    return block


_QUANTISERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_rows(x_RxN: np.ndarray, kind: str) -> np.ndarray:
    """Rows of N values (N a multiple of 256) as `kind` ("Q4_K", "Q5_K", "Q6_K") blocks -> uint8
    [R, N / 256 * BLOCK_BYTES[kind]], `_CHUNK` super-blocks at a time on every core (numpy lets go of the GIL)."""
    x_BxK = np.asarray(x_RxN, _F).reshape(-1, QK_K)
    out = np.empty((x_BxK.shape[0], BLOCK_BYTES[kind]), np.uint8)

    def chunk(start: int) -> None:
        out[start:start + _CHUNK] = _QUANTISERS[kind](x_BxK[start:start + _CHUNK])

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(chunk, range(0, x_BxK.shape[0], _CHUNK)))
    return out.reshape(*x_RxN.shape[:-1], -1)
