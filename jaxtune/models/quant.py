"""Frozen base weights as their own pytree types: QLoRA's NF4 and int8 (`NF4Array`, `Int8Array`; `quantize_nf4`,
`quantize_int8`, `dequantize`) and 16-bit kernels held as their bits (`BitPattern`, `as_bit_patterns`).

NF4 (Dettmers et al. 2023) stores 4-bit NormalFloat codes with one absmax per block, double quantisation those
absmax as 8-bit codes; `quantize_nf4` gives the bytes bitsandbytes stores for the same Hugging Face weight (blocks
over the torch layout [out, in], two codes a byte, high nibble first; ties, all-zero blocks and the offset as its
torch reference computes them). `quantize_int8` is LLM.int8()'s row-wise absmax without the outlier decomposition.
Children carry any stacking axes leading, so `lax.scan` slices a layer off and `dequantize` works on both; it is all
jax.numpy, so `jax.eval_shape` plans memory and `quantize_by_rows` quantises a kernel a few rows at a time as read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

# bitsandbytes `get_4bit_type("nf4")`: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)
NF4_BLOCKSIZE = 64
ABSMAX_BLOCKSIZE = 256  # double quantisation: bitsandbytes quantises the absmax in blocks of 256
INT8_INVERSE_SCALE = np.float32(1 / 127)  # bitsandbytes `int8_vectorwise_dequant` multiplies by this
SLICE_ELEMENTS = 1 << 20  # `quantize_by_rows` holds about this many values in float32 at a time


def _dynamic_map() -> np.ndarray:
    """bitsandbytes `create_dynamic_map(signed=True)`: 256 sorted float32 codes (Dettmers 2015, arXiv:1511.04561).

    For e = 0..6 the 2**e midpoints of `torch.linspace(0.1, 1, 2**e + 1)`, times 10**(e - 6), with both signs;
    then 0 and 1. The float32 steps are torch's: linspace is a fused multiply-add from the nearer end, and the
    scale is rounded to float32 before the multiply.
    """
    codes = [np.float32(0), np.float32(1)]
    start, end = np.float32(0.1), np.float32(1)
    for e in range(7):
        steps = 2**e + 1
        step = (end - start) / np.float32(steps - 1)
        i = np.arange(steps)
        # float64 holds these products and sums exactly, so one rounding to float32 is the fused multiply-add's.
        bounds = np.where(i < steps // 2, start + np.float64(step) * i, end - np.float64(step) * (steps - 1 - i))
        bounds = bounds.astype(np.float32)
        scaled = np.float32(10.0 ** (e - 6)) * ((bounds[:-1] + bounds[1:]) / np.float32(2))
        codes += [*scaled, *-scaled]
    return np.sort(np.array(codes, np.float32))


DYNAMIC_CODE = _dynamic_map()


@jax.tree_util.register_dataclass
@dataclass(frozen=True, eq=False)
class NF4Array:
    """An NF4 weight [..., in, out]: children carry the leading (layer) axes, `shape` is one matrix's [in, out].

    codes: uint8 [..., ceil(in*out / 2)], two codes per byte over the transposed matrix, first code high.
    absmax: float32 [..., n_blocks]; with double quantisation, uint8 codes of `absmax - offset` in DYNAMIC_CODE.
    absmax2: float32 [..., ceil(n_blocks / 256)], the absmax of those codes' blocks (double quantisation only).
    offset: float32 [...], the mean absmax (double quantisation only).
    """

    codes: jax.Array
    absmax: jax.Array
    absmax2: jax.Array | None
    offset: jax.Array | None
    shape: tuple[int, int] = field(metadata=dict(static=True))
    dtype: np.dtype = field(metadata=dict(static=True))
    blocksize: int = field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True, eq=False)
class Int8Array:
    """An int8 weight [..., in, out]: codes int8 [..., in, out], absmax float32 [..., out] per output channel."""

    codes: jax.Array
    absmax: jax.Array
    dtype: np.dtype = field(metadata=dict(static=True))


QuantizedArray = NF4Array | Int8Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BitPattern:
    """A frozen 16-bit float kernel [..., in, out] held as its uint16 bit pattern (the spine's frozen trees).

    XLA:CPU computes bfloat16 in float32 and, when a float stack is sliced by `lax.scan`, converts the whole
    stack to float32 before the loop: a frozen bfloat16 model then costs three times its bytes in the step. An
    integer stack is left alone, and each layer's slice is bitcast back where it is used (`dequantize`), which is
    free on every backend.

    layer: None for a kernel as it is stored or sliced; a layer's index when `bits` is the whole stack [L, in, out]
    and the kernel is that layer of it, read where it is used (`llama.unsliced_kernels`).
    """

    bits: jax.Array
    dtype: np.dtype = field(metadata=dict(static=True))
    layer: jax.Array | None = None


def as_bit_patterns(tree, head: bool = False):
    """`tree` (arrays, or ShapeDtypeStructs with their shardings) with each 16-bit float `kernel` under "layers"
    (and "layers"/"experts") as a BitPattern, and with `head` the embedding table and an `lm_head` kernel too (for
    a step that widens them, float32 compute: the head is then read a piece at a time from its bits,
    `linear.derived_piecewise_matmul`, the embedding a row at a time); None and trees without layers are returned
    as they are."""
    if not isinstance(tree, dict) or not isinstance(tree.get("layers"), dict):
        return tree

    def pack(kernel):
        if isinstance(kernel, jax.ShapeDtypeStruct):
            return BitPattern(jax.ShapeDtypeStruct(kernel.shape, jnp.uint16, sharding=kernel.sharding), kernel.dtype)
        return BitPattern(jax.lax.bitcast_convert_type(kernel, jnp.uint16), kernel.dtype)

    def packable(kernel) -> bool:
        return (isinstance(kernel, jax.Array | jax.ShapeDtypeStruct) and jnp.issubdtype(kernel.dtype, jnp.floating)
                and jnp.dtype(kernel.dtype).itemsize == 2)

    def module(m):
        return {**m, "kernel": pack(m["kernel"])} if isinstance(m, dict) and packable(m.get("kernel")) else m

    def entry(name, m):  # a mixture's experts are modules a level down
        return {k: module(e) for k, e in m.items()} if name == "experts" else module(m)

    tree = {**tree, "layers": {name: entry(name, m) for name, m in tree["layers"].items()}}
    if head and packable(tree.get("embed_tokens")):
        tree["embed_tokens"] = pack(tree["embed_tokens"])
    if head and "lm_head" in tree:
        tree["lm_head"] = module(tree["lm_head"])
    return tree


def from_bit_patterns(tree):
    """`tree` with every BitPattern bitcast back to its float kernel (jit-able)."""
    return jax.tree.map(lambda x: dequantize(x) if isinstance(x, BitPattern) else x, tree,
                        is_leaf=lambda x: isinstance(x, BitPattern))


def _rounded(x: jax.Array) -> jax.Array:
    """x, unchanged, as an operand XLA cannot contract into a fused multiply-add with the next add.

    Under jit XLA turns a * b + c into fma(a, b, c), rounding once (openxla/xla#41579); bitsandbytes rounds the
    product first. A select on x == x hides the product from that rewrite and keeps NaN as NaN.
    """
    return jnp.where(x == x, x, jnp.nan)


def _sum_f32(x_BxN: jax.Array) -> jax.Array:
    """[B, N] -> [B]: the sum rounded once to float32 (to 2**-48 relative), whatever the backend's order.

    Adds pairwise and carries each addition's rounding error with TwoSum (Knuth, TAOCP vol. 2, 4.2.2).
    """
    hi_BxN, lo_BxN = x_BxN, jnp.zeros_like(x_BxN)
    while hi_BxN.shape[-1] > 1:
        if hi_BxN.shape[-1] % 2:
            hi_BxN, lo_BxN = (jnp.pad(t, ((0, 0), (0, 1))) for t in (hi_BxN, lo_BxN))
        a, b = hi_BxN[:, 0::2], hi_BxN[:, 1::2]
        s = a + b
        b_virtual = s - a
        error = (a - (s - b_virtual)) + (b - b_virtual)
        hi_BxN, lo_BxN = s, lo_BxN[:, 0::2] + lo_BxN[:, 1::2] + error
    return hi_BxN[:, 0] + lo_BxN[:, 0]


# As bitsandbytes 0.50 (`backends/default/ops.py`, `csrc/kernels.cu`): values scaled by the float32 reciprocal of
# their block's absmax; a value exactly on a midpoint takes the lower code; an all-zero block has absmax 0.
def _quantize_blocks(x_BxN: jax.Array, code: np.ndarray, blocksize: int) -> tuple[jax.Array, jax.Array]:
    """bitsandbytes' blockwise absmax quantisation of each row to the nearest value of the sorted `code`.

    Returns code indices int32 [B, K * blocksize] (the zero padding of the last block gets the code of 0.0)
    and absmax float32 [B, K], with K = ceil(N / blocksize).
    """
    B, N = x_BxN.shape
    K = -(-N // blocksize)
    x_BxKxS = jnp.pad(x_BxN, ((0, 0), (0, K * blocksize - N))).reshape(B, K, blocksize)
    absmax_BxK = jnp.max(jnp.abs(x_BxKxS), axis=-1)
    inverse_BxK = jnp.where(absmax_BxK > 0, 1 / absmax_BxK, 0)  # an all-zero block maps to the code of 0.0
    midpoints = (code[:-1] + code[1:]) / np.float32(2)  # float32, like bitsandbytes' bounds
    # side="left" counts midpoints strictly below the value: a value on a midpoint takes the lower code.
    # compare_all fuses into one pass (about 10x the default binary search on CPU for NF4's 15 midpoints); for the
    # 255 of double quantisation's map it would hold a [B, N, 255] comparison, so a binary search there.
    idx_BxKxS = jnp.searchsorted(jnp.asarray(midpoints), x_BxKxS * inverse_BxK[..., None], side="left",
                                 method="compare_all" if len(midpoints) < 16 else "scan")
    return idx_BxKxS.reshape(B, K * blocksize), absmax_BxK


def _dequantize_blocks(idx_xN: jax.Array, absmax_xK: jax.Array, code: np.ndarray, blocksize: int) -> jax.Array:
    """[..., N] code indices and [..., K] absmax -> [..., N] float32 values code[idx] * absmax of the block."""
    *lead, N = idx_xN.shape
    K = absmax_xK.shape[-1]
    values_xN = jnp.asarray(code)[idx_xN]
    values_xP = jnp.pad(values_xN, [(0, 0)] * len(lead) + [(0, K * blocksize - N)])
    values_xKxS = values_xP.reshape(*lead, K, blocksize) * absmax_xK[..., None]
    return values_xKxS.reshape(*lead, K * blocksize)[..., :N]


@partial(jax.jit, static_argnames=("blocksize",))
def nf4_codes(x_BxN: jax.Array, blocksize: int = NF4_BLOCKSIZE) -> tuple[jax.Array, jax.Array]:
    """[B, N] values -> (packed codes uint8 [B, ceil(N / 2)], absmax float32 [B, ceil(N / blocksize)])."""
    n = x_BxN.shape[-1]
    idx_BxP, absmax_BxK = _quantize_blocks(x_BxN.astype(jnp.float32), NF4_CODE, blocksize)
    idx_BxE = idx_BxP[:, : n + n % 2].astype(jnp.uint8)  # an odd count is padded with the code of 0.0
    return (idx_BxE[:, 0::2] << 4) | idx_BxE[:, 1::2], absmax_BxK


@jax.jit
def _double_quantize(absmax_BxK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 absmax [B, K] -> (uint8 codes of absmax - offset [B, K], their absmax [B, J], offset [B])."""
    K = absmax_BxK.shape[-1]
    offset_B = _rounded(_sum_f32(absmax_BxK) * np.float32(1 / K))  # torch's CUDA mean: sum * float32 1/K
    idx2_BxP, absmax2_BxJ = _quantize_blocks(absmax_BxK - offset_B[:, None], DYNAMIC_CODE, ABSMAX_BLOCKSIZE)
    return idx2_BxP[:, :K].astype(jnp.uint8), absmax2_BxJ, offset_B


@partial(jax.jit, static_argnames=("double_quant", "blocksize"))
def quantize_nf4(w: jax.Array, double_quant: bool = False, blocksize: int = NF4_BLOCKSIZE) -> NF4Array:
    """[..., in, out] weight -> NF4Array, each [in, out] matrix quantised as bitsandbytes quantises its [out, in].

    Leading axes (layers) are kept on every child.
    """
    *lead, d_in, d_out = w.shape
    codes_BxH, absmax_BxK = nf4_codes(jnp.swapaxes(w, -1, -2).reshape(-1, d_in * d_out), blocksize)
    absmax2 = offset = None
    if double_quant:
        absmax_BxK, absmax2_BxJ, offset_B = _double_quantize(absmax_BxK)
        absmax2, offset = absmax2_BxJ.reshape(*lead, -1), offset_B.reshape(lead)
    return NF4Array(codes=codes_BxH.reshape(*lead, -1), absmax=absmax_BxK.reshape(*lead, -1), absmax2=absmax2,
                    offset=offset, shape=(d_in, d_out), dtype=np.dtype(w.dtype), blocksize=blocksize)


def row_slices(d_out: int, d_in: int, multiple: int, max_elements: int = SLICE_ELEMENTS) -> list[tuple[int, int]]:
    """[start, stop) ranges over `d_out` rows of `d_in` values, each range (but the last) holding a multiple of
    `multiple` values and at most about `max_elements`."""
    step = multiple // math.gcd(multiple, d_in)
    rows = max(step, max_elements // d_in // step * step)
    return [(o, min(o + rows, d_out)) for o in range(0, d_out, rows)]


def quantize_by_rows(read_rows, shape: tuple[int, int], dtype, bits: int, double_quant: bool = False,
                     max_elements: int = SLICE_ELEMENTS) -> QuantizedArray:
    """`quantize_nf4` (bits 4) or `quantize_int8` (bits 8) of one [in, out] weight, bit for bit, read as row
    slices of its torch layout: `read_rows(start, stop)` -> [stop - start, in] values of rows start:stop of the
    [out, in] weight. At most about `max_elements` values are in float32 at a time (NF4's blocks run along those
    rows and are never cut; double quantisation needs every block's absmax, kept until the end). Children are
    host numpy arrays."""
    d_in, d_out = shape
    if bits == 8:
        parts = [quantize_int8(jnp.asarray(read_rows(a, b)).T) for a, b in row_slices(d_out, d_in, 1, max_elements)]
        return Int8Array(codes=np.concatenate([np.asarray(q.codes) for q in parts], axis=-1),
                         absmax=np.concatenate([np.asarray(q.absmax) for q in parts]), dtype=np.dtype(dtype))
    n = d_in * d_out
    codes_H: np.ndarray = np.empty(-(-n // 2), np.uint8)
    absmax_K: np.ndarray = np.empty(-(-n // NF4_BLOCKSIZE), np.float32)
    for a, b in row_slices(d_out, d_in, NF4_BLOCKSIZE, max_elements):
        codes_1xH, absmax_1xK = nf4_codes(jnp.asarray(read_rows(a, b)).reshape(1, -1))
        codes_H[a * d_in // 2: a * d_in // 2 + codes_1xH.shape[1]] = np.asarray(codes_1xH[0])
        absmax_K[a * d_in // NF4_BLOCKSIZE: a * d_in // NF4_BLOCKSIZE + absmax_1xK.shape[1]] = np.asarray(absmax_1xK[0])
    absmax2 = offset = None
    if double_quant:
        absmax_1xK, absmax2_1xJ, offset_1 = (np.asarray(x) for x in _double_quantize(absmax_K[None]))
        absmax_K, absmax2, offset = absmax_1xK[0], absmax2_1xJ[0], offset_1[0]
    return NF4Array(codes=codes_H, absmax=absmax_K, absmax2=absmax2, offset=offset, shape=(d_in, d_out),
                    dtype=np.dtype(dtype), blocksize=NF4_BLOCKSIZE)


@jax.jit
def quantize_int8(w: jax.Array) -> Int8Array:
    """[..., in, out] weight -> Int8Array: per output channel, round(x * 127 / absmax) (bitsandbytes'
    `int8_vectorwise_quant` on the torch rows, i.e. scale = absmax / 127 and round half to even)."""
    x = w.astype(jnp.float32)
    absmax_xO = jnp.max(jnp.abs(x), axis=-2)
    multiplier_xO = jnp.where(absmax_xO > 0, np.float32(127) / absmax_xO, 0)
    codes = jnp.round(x * multiplier_xO[..., None, :]).astype(jnp.int8)
    return Int8Array(codes=codes, absmax=absmax_xO, dtype=np.dtype(w.dtype))


def dequantize(q: QuantizedArray | BitPattern) -> jax.Array:
    """The weight [..., in, out] in `q.dtype`, computed in float32 as bitsandbytes dequantises; jit-able, and
    correct on a stacked weight and on one layer of it sliced off by `lax.scan`."""
    if isinstance(q, BitPattern):
        return jax.lax.bitcast_convert_type(q.bits if q.layer is None else q.bits[q.layer], q.dtype)
    if isinstance(q, Int8Array):
        return (q.codes.astype(jnp.float32) * q.absmax[..., None, :] * INT8_INVERSE_SCALE).astype(q.dtype)
    lead = q.codes.shape[:-1]
    d_in, d_out = q.shape
    absmax = absmax_of(q)
    if d_in % q.blocksize == 0:
        return _nf4_matrix(q.codes, absmax, d_in, d_out, q.blocksize).astype(q.dtype)
    idx_xE = jnp.stack([q.codes >> 4, q.codes & 0xF], axis=-1).reshape(*lead, -1)
    x_xN = _dequantize_blocks(idx_xE, absmax, NF4_CODE, q.blocksize)[..., : d_in * d_out]
    return jnp.swapaxes(x_xN.reshape(*lead, d_out, d_in), -1, -2).astype(q.dtype)


def _nf4_matrix(codes_xH: jax.Array, absmax_xK: jax.Array, d_in: int, d_out: int, blocksize: int) -> jax.Array:
    """NF4 codes of [d_out, d_in] (bitsandbytes' order: the transposed matrix, two codes a byte, first high) and
    their block absmax -> the float32 matrix [..., d_in, d_out], for d_in a multiple of the block size.

    Byte j of output row o holds inputs 2j (high) and 2j + 1 (low), so the high and low codes, transposed, are the
    even and odd rows: W viewed as [d_in / 2, 2 d_out] is [high | low]. No array has a dimension of 2 or of a block's
    64: on TPU such a minor dimension is padded to 128 lanes (an [n, 2] unpacking of Mixtral's expert codes took
    30 GB a chip)."""
    *lead, _ = codes_xH.shape
    code = jnp.asarray(NF4_CODE)
    codes_xIxO = jnp.swapaxes(codes_xH.reshape(*lead, d_out, d_in // 2), -1, -2)
    scale_xBxO = jnp.swapaxes(absmax_xK.reshape(*lead, d_out, d_in // blocksize), -1, -2)
    scale_xIxO = jnp.repeat(scale_xBxO, blocksize // 2, axis=-2)  # [..., d_in / 2, d_out]: a byte row's block
    high, low = code[codes_xIxO >> 4] * scale_xIxO, code[codes_xIxO & 0xF] * scale_xIxO
    return jnp.concatenate([high, low], axis=-1).reshape(*lead, d_in, d_out)


def column_multiple(q: QuantizedArray) -> int:
    """The output columns of one matrix of `q` that a slice of its stored arrays must count and start at a multiple
    of (`dequantize_columns`): NF4's blocks run along the torch rows, so whole blocks; 0 where no such slice tiles
    the matrix (its last block padded)."""
    if not isinstance(q, NF4Array):
        return 1
    d_in, d_out = q.shape
    step = q.blocksize // math.gcd(q.blocksize, d_in)
    return step if (d_in * d_out) % q.blocksize == 0 else 0


def absmax_of(q: NF4Array) -> jax.Array:
    """An NF4 weight's float32 block absmax [..., n_blocks], decoded from double quantisation if it has one."""
    if q.offset is None:
        return q.absmax
    centred_xK = _dequantize_blocks(q.absmax, q.absmax2, DYNAMIC_CODE, ABSMAX_BLOCKSIZE)
    return _rounded(centred_xK) + q.offset[..., None]


def dequantize_columns(q: QuantizedArray, start: jax.Array, width: int, absmax: jax.Array | None = None
                       ) -> jax.Array:
    """Output columns start:start + width of one matrix [in, out] of `q` in `q.dtype`, exactly those columns of
    `dequantize(q)`, from the slices of its stored arrays that hold them (`start` may be traced; for NF4 it and
    `width` are multiples of `column_multiple(q)`). absmax: NF4's decoded `absmax_of(q)`, if already at hand."""
    if isinstance(q, Int8Array):
        codes = jax.lax.dynamic_slice_in_dim(q.codes, start, width, axis=-1)
        scale = jax.lax.dynamic_slice_in_dim(q.absmax, start, width, axis=-1)
        return (codes.astype(jnp.float32) * scale[..., None, :] * INT8_INVERSE_SCALE).astype(q.dtype)
    d_in = q.shape[0]
    absmax = absmax_of(q) if absmax is None else absmax
    codes_xH = jax.lax.dynamic_slice_in_dim(q.codes, start * d_in // 2, width * d_in // 2, axis=-1)
    absmax_xK = jax.lax.dynamic_slice_in_dim(absmax, start * d_in // q.blocksize, width * d_in // q.blocksize, axis=-1)
    if d_in % q.blocksize == 0:
        return _nf4_matrix(codes_xH, absmax_xK, d_in, width, q.blocksize).astype(q.dtype)
    idx_xE = jnp.stack([codes_xH >> 4, codes_xH & 0xF], axis=-1).reshape(*codes_xH.shape[:-1], -1)
    x_xN = _dequantize_blocks(idx_xE, absmax_xK, NF4_CODE, q.blocksize)
    return jnp.swapaxes(x_xN.reshape(*x_xN.shape[:-1], width, d_in), -1, -2).astype(q.dtype)


def nbytes(q: QuantizedArray) -> int:
    """Bytes held by q's arrays (works on `jax.eval_shape` output too)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(q))


def full_shape(leaf) -> tuple[int, ...]:
    """A leaf's logical shape: [L, in, out] for a stacked quantised kernel (whose `shape` is one layer's)."""
    if isinstance(leaf, NF4Array):
        return tuple(leaf.codes.shape[:-1]) + tuple(leaf.shape)
    return tuple(leaf.codes.shape if isinstance(leaf, Int8Array) else leaf.shape)
