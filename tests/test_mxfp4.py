"""MXFP4 as gpt-oss releases its experts: decoded equal to transformers' own dequantisation, and a checkpoint stored
so loads, an expert slice at a time, into the same stacks as its float copy."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxtune.models import stacked_experts
from jaxtune.models.mxfp4 import decode_mxfp4, encode_mxfp4
from jaxtune.spine.model import load_model

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("dtype, torch_dtype", [(np.float32, torch.float32), (ml_dtypes.bfloat16, torch.bfloat16)])
def test_decode_equals_transformers_bit_for_bit(dtype, torch_dtype):
    """Every nibble and scales across the range a model uses (2**-20 .. 2**10): transformers' output [E, in, out]
    is ours [E, out, in] transposed."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)
    scales = rng.integers(127 - 20, 127 + 10, (3, 8, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype)
    ours = np.swapaxes(decode_mxfp4(blocks, scales, dtype), 1, 2)
    np.testing.assert_array_equal(ours.astype(np.float32), theirs.float().numpy())


def test_encode_is_exact_on_the_grid_and_nearest_off_it():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (5, 2, 16), dtype=np.uint8)
    blocks[..., 0] |= 0x07  # a 6 (or -6) in every block, so its scale is the one the encoder picks
    scales = rng.integers(100, 140, (5, 2), dtype=np.uint8)
    grid = decode_mxfp4(blocks, scales)
    np.testing.assert_array_equal(decode_mxfp4(*encode_mxfp4(grid)), grid)
    x = rng.normal(size=(7, 64)).astype(np.float32)
    coded = decode_mxfp4(*encode_mxfp4(x))
    scale = 2.0 ** np.ceil(np.log2(np.abs(x).reshape(7, 2, 32).max(-1) / 6))
    assert np.all(np.abs(coded - x).reshape(7, 2, 32) <= scale[..., None])  # half E2M1's widest gap (2), scaled


def test_a_checkpoint_with_mxfp4_experts_loads_as_its_dequantised_copy(hf_model_dir, tmp_path):
    """The tiny gpt-oss with its expert kernels on the MXFP4 grid, saved once as float and once as released
    (blocks and scales in place of the kernels): the two load to equal trees."""
    directory, _ = hf_model_dir("gpt_oss")
    state = load_file(str(directory / "model.safetensors"))
    as_float, released = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = encode_mxfp4(np.swapaxes(state[name], 1, 2))  # [E, out, in] in blocks along in
        as_float[name] = np.ascontiguousarray(np.swapaxes(decode_mxfp4(blocks, scales), 1, 2))
        del released[name]
        released[name + "_blocks"], released[name + "_scales"] = blocks, scales
    for where, tensors in (("float", as_float), ("released", released)):
        (tmp_path / where).mkdir()
        (tmp_path / where / "config.json").write_text((directory / "config.json").read_text())
        save_file(tensors, str(tmp_path / where / "model.safetensors"), metadata={"format": "pt"})
    cfg, params = load_model(tmp_path / "float")
    cfg_q, params_q = load_model(tmp_path / "released")
    assert cfg_q == cfg and stacked_experts.is_quantized(released)
    for stack in stacked_experts.STACKS:
        np.testing.assert_array_equal(params_q["layers"]["experts"][stack]["kernel"],
                                      params["layers"]["experts"][stack]["kernel"])
    assert json.loads((directory / "config.json").read_text())["model_type"] == "gpt_oss"
