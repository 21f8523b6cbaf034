"""NF4 / int8 frozen weights against an independent numpy restatement of bitsandbytes (QLoRA, arXiv:2305.14314).

The reference below is written from bitsandbytes 0.50 (`functional.quantize_4bit`, `backends/default/ops.py`,
`csrc/kernels.cu`), not from jaxtune: it computes in float64 and rounds to float32 exactly where bitsandbytes
computes in float32 (the reciprocal of the absmax, the scaled value, the dequantised products), which gives the
same float32 results for these operations. NF4 codes come from the CUDA kernel's decision tree of midpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtune.models.quant import (
    DYNAMIC_CODE,
    NF4Array,
    QuantizedArray,
    dequantize,
    nbytes,
    quantize_by_rows,
    quantize_int8,
    quantize_nf4,
)

pytestmark = pytest.mark.parity  # also run with AVX2 forced (.ci/run)

f32 = np.float32
REF_NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0], np.float32)


def ref_nf4_index(x: np.ndarray) -> np.ndarray:
    """bitsandbytes `dQuantizeNF4` (csrc/kernels.cu): `x > midpoint` sends a value up, so ties go down."""
    w = np.where
    return w(x > f32(0.03979014977812767),
             w(x > f32(0.3893125355243683),
               w(x > f32(0.6427869200706482), w(x > f32(0.8614784181118011), 15, 14),
                 w(x > f32(0.5016634166240692), 13, 12)),
               w(x > f32(0.2035212516784668), w(x > f32(0.2920137718319893), 11, 10),
                 w(x > f32(0.1202552504837513), 9, 8))),
             w(x > f32(-0.33967943489551544),
               w(x > f32(-0.13791173323988914), w(x > f32(-0.045525018125772476), 7, 6),
                 w(x > f32(-0.23460740596055984), 5, 4)),
               w(x > f32(-0.6106329262256622), w(x > f32(-0.4599952697753906), 3, 2),
                 w(x > f32(-0.8480964004993439), 1, 0))))


def torch_dynamic_map() -> np.ndarray:
    """bitsandbytes `create_dynamic_map(signed=True)`, run with torch as bitsandbytes runs it."""
    import torch

    data = [0.0, 1.0]
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist() + (-(10 ** (i - 6)) * means).tolist()
    return np.array(sorted(data), np.float32)


def ref_blockwise(x: np.ndarray, blocksize: int, index_fn) -> tuple[np.ndarray, np.ndarray]:
    """Absmax per block (zero-padded tail), float32 x * (1 / absmax), then `index_fn`: (indices [N], absmax [K])."""
    n = x.size
    k = -(-n // blocksize)
    x_KxS = np.concatenate([x.astype(np.float64), np.zeros(k * blocksize - n)]).reshape(k, blocksize)
    absmax = np.abs(x_KxS).max(axis=1)
    inverse = np.where(absmax > 0, 1 / np.where(absmax > 0, absmax, 1), 0).astype(f32).astype(np.float64)
    scaled = (x_KxS * inverse[:, None]).astype(f32).astype(np.float64)
    return index_fn(scaled).reshape(-1), absmax.astype(f32)


def ref_dynamic_index(z: np.ndarray) -> np.ndarray:
    """Nearest code of the dynamic map: count the float32 midpoints strictly below (bucketize, ties down)."""
    code = torch_dynamic_map().astype(np.float64)
    midpoints = ((code[:-1] + code[1:]) / 2).astype(f32).astype(np.float64)
    return (z[..., None] > midpoints).sum(axis=-1)


def ref_quantize_nf4(w_IxO: np.ndarray, double_quant: bool) -> dict:
    """One matrix, quantised as bitsandbytes quantises the Hugging Face weight w.T [out, in]."""
    x = w_IxO.astype(np.float64).T.reshape(-1)
    n = x.size
    idx, absmax = ref_blockwise(x, 64, ref_nf4_index)
    idx = idx[: n + n % 2]  # odd n: bitsandbytes pads with 0.0, whose code is 7
    out = {"codes": ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8), "absmax": absmax}
    if double_quant:
        offset = f32(np.float64(f32(np.sum(absmax, dtype=np.float64))) * np.float64(f32(1 / absmax.size)))
        centred = (absmax.astype(np.float64) - offset).astype(f32)
        idx2, absmax2 = ref_blockwise(centred, 256, ref_dynamic_index)
        out.update(absmax=idx2[: absmax.size].astype(np.uint8), absmax2=absmax2, offset=offset)
    return out


def ref_dequantize_nf4(ref: dict, shape: tuple[int, int]) -> np.ndarray:
    absmax = ref["absmax"].astype(np.float64)
    if "offset" in ref:
        code = torch_dynamic_map().astype(np.float64)
        scales = np.repeat(ref["absmax2"].astype(np.float64), 256)[: absmax.size]
        absmax = (code[ref["absmax"]] * scales).astype(f32).astype(np.float64)
        absmax = (absmax + np.float64(ref["offset"])).astype(f32).astype(np.float64)
    idx = np.stack([ref["codes"] >> 4, ref["codes"] & 15], axis=-1).reshape(-1)[: shape[0] * shape[1]]
    x = (REF_NF4.astype(np.float64)[idx] * np.repeat(absmax, 64)[: idx.size]).astype(f32)
    return x.reshape(shape[1], shape[0]).T


def weights(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random N(0, 0.02) weights [L, in, out] with an all-zero block, an all-zero tail block and a zero layer."""
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(f32)
    hf_view = np.swapaxes(w, -1, -2).reshape(shape[0], -1)  # bitsandbytes' blocks run over this
    hf_view[0, 64:128] = 0
    hf_view[1, (hf_view.shape[1] - 1) // 64 * 64:] = 0
    hf_view[-1] = 0
    return np.swapaxes(hf_view.reshape(shape[0], shape[2], shape[1]), -1, -2).copy()


def nf4_indices(q: NF4Array) -> np.ndarray:
    """The unpacked 4-bit codes of a single matrix, in bitsandbytes' order."""
    return np.stack([np.asarray(q.codes) >> 4, np.asarray(q.codes) & 15], axis=-1).reshape(-1)


@pytest.mark.parametrize("shape", [(3, 37, 29), (3, 128, 96)])  # 1073 values: odd, with a 49-value tail block
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_nf4_codes_and_absmax_equal_reference(shape, dtype):
    w = weights(shape).astype(dtype)
    q = quantize_nf4(jnp.asarray(w))
    assert q.shape == shape[1:] and q.dtype == np.dtype(dtype) and q.absmax2 is None and q.offset is None
    for layer in range(shape[0]):
        ref = ref_quantize_nf4(w[layer].astype(f32), double_quant=False)
        np.testing.assert_array_equal(np.asarray(q.codes[layer]), ref["codes"])
        np.testing.assert_array_equal(np.asarray(q.absmax[layer]), ref["absmax"])


def test_nf4_values_on_midpoints_take_the_lower_code():
    midpoints = ((REF_NF4[:-1].astype(np.float64) + REF_NF4[1:]) / 2).astype(f32)
    np.testing.assert_array_equal(ref_nf4_index(midpoints), np.arange(15))  # the tree's constants are these
    block = np.zeros(64, f32)  # absmax 1, so x * (1 / absmax) is x itself
    block[:46] = np.concatenate([[1.0], midpoints, np.nextafter(midpoints, f32(2)), np.nextafter(midpoints, f32(-2))])
    w_IxO = np.stack([block, 2 * block], axis=1)  # second block: absmax 2, scaled exactly by 0.5
    idx = nf4_indices(quantize_nf4(jnp.asarray(w_IxO)))
    expected = np.concatenate([[15], np.arange(15), np.arange(1, 16), np.arange(15), np.full(18, 7)])
    np.testing.assert_array_equal(idx, np.concatenate([expected, expected]))
    np.testing.assert_array_equal(idx, ref_nf4_index(np.concatenate([block, block])))


@pytest.mark.reference
def test_dynamic_map_equals_bitsandbytes_recipe_run_in_torch():
    np.testing.assert_array_equal(DYNAMIC_CODE, torch_dynamic_map())


@pytest.mark.reference
@pytest.mark.parametrize("shape", [(4, 160, 256), (3, 37, 29)])  # 640 absmax: 3 blocks of 256, the last a tail
def test_double_quant_equals_reference(shape):
    w = weights(shape, seed=1)
    q = quantize_nf4(jnp.asarray(w), double_quant=True)
    assert q.absmax.dtype == np.uint8
    for layer in range(shape[0]):
        ref = ref_quantize_nf4(w[layer], double_quant=True)
        np.testing.assert_array_equal(np.asarray(q.codes[layer]), ref["codes"])
        np.testing.assert_array_equal(np.asarray(q.absmax[layer]), ref["absmax"])
        np.testing.assert_array_equal(np.asarray(q.absmax2[layer]), ref["absmax2"])
        assert np.asarray(q.offset[layer]) == ref["offset"]


@pytest.mark.reference
@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_equals_reference_and_is_close(double_quant):
    w = weights((3, 160, 96), seed=2)
    q = quantize_nf4(jnp.asarray(w), double_quant=double_quant)
    got = np.asarray(dequantize(q))
    assert got.dtype == np.float32 and got.shape == w.shape
    np.testing.assert_array_equal(jax.jit(dequantize)(q), got)  # no FMA contraction under jit
    for layer in range(3):
        ref = ref_quantize_nf4(w[layer], double_quant)
        np.testing.assert_array_equal(got[layer], ref_dequantize_nf4(ref, w.shape[1:]))
    # The widest gap between NF4 codes is 1 - 0.7229568: no value moves more than half of it times its absmax.
    assert np.abs(got - w).max() <= 0.139 * np.abs(w).max() * (1.01 if double_quant else 1)
    assert np.sqrt(np.mean((got - w) ** 2) / np.mean(w**2)) < 0.12


def test_int8_rowwise_absmax():
    w = weights((2, 96, 40), seed=3)
    q = quantize_int8(jnp.asarray(w))
    absmax = np.abs(w).max(axis=1)  # per output channel: a row of the Hugging Face weight
    multiplier = np.where(absmax > 0, f32(127) / np.where(absmax > 0, absmax, 1), 0).astype(f32)
    np.testing.assert_array_equal(np.asarray(q.codes), np.round(w * multiplier[:, None, :]).astype(np.int8))
    np.testing.assert_array_equal(np.asarray(q.absmax), absmax)
    assert np.all(np.abs(np.asarray(dequantize(q)) - w) <= absmax[:, None, :] / 254 * 1.001)


@pytest.mark.parametrize("bits,double_quant", [(4, False), (4, True), (8, False)], ids=["nf4", "nf4_dq", "int8"])
@pytest.mark.parametrize("shape,max_elements", [((96, 700), 1000), ((37, 291), 5000), ((256, 40), 1 << 20)])
def test_quantize_by_rows_is_the_whole_matrix_quantised(bits, double_quant, shape, max_elements):
    """Loading quantises a few rows of the torch layout at a time: bit for bit the whole matrix's result, for
    rows that do not hold a whole number of blocks (96 and 37 values), an odd count of values, and one slice."""
    w_IxO = weights((2, *shape), seed=6)[0].astype(ml_dtypes.bfloat16)  # with an all-zero block
    rows_read = []

    def read_rows(a, b):
        rows_read.append(b - a)
        return w_IxO.T[a:b]

    got = quantize_by_rows(read_rows, shape, ml_dtypes.bfloat16, bits, double_quant, max_elements)
    whole = quantize_int8(jnp.asarray(w_IxO)) if bits == 8 else quantize_nf4(jnp.asarray(w_IxO), double_quant)
    assert type(got) is type(whole) and got.dtype == whole.dtype
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert sum(rows_read) == shape[1] and max(rows_read) * shape[0] <= max_elements
    assert (len(rows_read) > 1) == (w_IxO.size > max_elements)


def test_bytes_per_parameter():
    w = jnp.asarray(np.random.default_rng(4).standard_normal((2, 1024, 1024), f32))
    ratios = {name: nbytes(fn(w)) / w.size for name, fn in [
        ("nf4", quantize_nf4), ("nf4_dq", lambda x: quantize_nf4(x, double_quant=True)), ("int8", quantize_int8)]}
    assert ratios["nf4"] <= 0.57 and ratios["nf4_dq"] <= 0.52 and ratios["int8"] <= 1.01, ratios
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)  # planned without allocating
    assert nbytes(jax.eval_shape(quantize_nf4, big)) / big.size == pytest.approx(0.5625)
    assert nbytes(jax.eval_shape(lambda x: quantize_nf4(x, double_quant=True), big)) / big.size <= 0.5160


@pytest.mark.parametrize("quantize", [quantize_nf4, lambda x: quantize_nf4(x, double_quant=True), quantize_int8],
                         ids=["nf4", "nf4_dq", "int8"])
def test_jit_and_scan_over_a_stacked_weight(quantize):
    w = jnp.asarray(weights((3, 64, 96), seed=5))
    q = quantize(w)
    assert isinstance(q, QuantizedArray)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(jax.jit(quantize)(w))))
    np.testing.assert_array_equal(jax.jit(dequantize)(q), dequantize(q))

    def step(carry, layer_q):
        return carry, dequantize(layer_q)

    _, per_layer = jax.jit(lambda q: jax.lax.scan(step, None, q))(q)
    for layer in range(3):
        np.testing.assert_array_equal(per_layer[layer], dequantize(quantize(w[layer])))
