"""Qwen2.5-VL's vision parts equal transformers': the image processor (`Qwen2VLImageProcessorPil`, torchvision
absent) on Pillow-made images of several sizes and modes, the padded window layout, the vision tower read from a tiny
random checkpoint (after the merger, one image and three, padded), `get_rope_index` and the M-RoPE cos/sin and
rotation."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from safetensors.numpy import load_file, save_file
from transformers import vision_utils
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from jaxtune.config import tiny_config
from jaxtune.models.rope import apply_rope, mrope_angles
from jaxtune.models.vision.qwen2_5_vl import image_placement
from jaxtune.models.vision.qwen_vl_config import QwenImageOptions, image_options_from_hf, vision_config_from_hf
from jaxtune.models.vision.qwen_vl_processor import image_patches, smart_resize
from jaxtune.models.vision.qwen_vl_vision import padded_layout, padded_vision_forward
from jaxtune.models.vision.qwen_vl_weights import read_vision_params

pytestmark = [pytest.mark.parity, pytest.mark.reference]

IMAGE, VISION_START, VISION_END = 90, 92, 93  # the tiny model's image placeholder and its brackets
MROPE_SECTION = [2, 3, 3]  # of the text's 8 rotary frequencies (head_dim 16)
# patches of 4 pixels, merged 2 x 2, windows of 2 x 2 merged tokens (16 pixels); block 2 of 4 attends fully
VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, window_size=16, out_hidden_size=24, fullatt_block_indexes=[2])


def generated_images() -> list[Image.Image]:
    """Six Pillow-made images: shapes over noise, of different sizes, aspect ratios and modes (RGB, RGBA with
    partial transparency, grayscale L and LA, a palette image with a transparent colour)."""
    rng = np.random.RandomState(0)
    images = []
    for mode, (w, h) in [("RGB", (100, 60)), ("RGBA", (37, 91)), ("L", (300, 20)), ("RGB", (64, 64)),
                         ("LA", (513, 211)), ("P", (45, 140))]:
        noise = Image.fromarray(rng.randint(0, 256, (h, w, 4), np.uint8), "RGBA")
        draw = ImageDraw.Draw(noise)
        for _ in range(4):
            x0, y0 = rng.randint(0, w), rng.randint(0, h)
            draw.ellipse([x0, y0, x0 + rng.randint(1, w), y0 + rng.randint(1, h)],
                         fill=tuple(int(v) for v in rng.randint(0, 256, 4)))
        image = noise.convert("RGB").convert("P") if mode == "P" else noise.convert(mode)
        if mode == "P":
            image.info["transparency"] = 7
        images.append(image)
    return images


@pytest.mark.parametrize("min_pixels,max_pixels", [(56 * 56, 28 * 28 * 1280), pytest.param(
    32 * 32, 64 * 64, marks=pytest.mark.full), pytest.param(100 * 100, 200 * 200, marks=pytest.mark.full)])
def test_image_processor_equals_transformers(min_pixels, max_pixels, tmp_path):
    """pixel_values equal to float32 rounding, image_grid_thw exactly, each image alone and all together, with the
    options read from the processor's saved preprocessor_config.json; each image's token count from its size."""
    images = generated_images()
    reference = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    reference.save_pretrained(tmp_path)
    options = image_options_from_hf(json.loads((tmp_path / "preprocessor_config.json").read_text()))
    assert options == QwenImageOptions(min_pixels=min_pixels, max_pixels=max_pixels, rescale_factor=1 / 255)
    for batch in [images] + [[image] for image in images]:
        expected = reference(batch, return_tensors="np")
        values, grids = image_patches(batch, options)
        np.testing.assert_array_equal(grids, expected["image_grid_thw"])
        np.testing.assert_allclose(values, expected["pixel_values"], rtol=1e-6, atol=1e-6)
    for image in images:  # the patches an image takes, from its size alone, as vLLM asks the processor
        h, w = smart_resize(image.height, image.width, options.factor, options.min_pixels, options.max_pixels)
        assert h * w // 14**2 == reference.get_number_of_image_patches(image.height, image.width)


def test_layout_equals_transformers():
    """Window membership, patch positions and per-frame segments of `padded_layout` (slots in the processor's order)
    as `vision_utils` computes them, on grids whose merged sides are and are not multiples of the window, and a
    two-frame one."""
    cfg = vision_config_from_hf(VISION)
    grids = np.array([[1, 12, 8], [2, 4, 4], [1, 10, 14], [1, 2, 18]])
    N = int(grids.prod(-1).max()) + 4
    positions, windows, frames = (np.asarray(a) for a in padded_layout(jnp.asarray(grids), N, cfg))
    for i, grid in enumerate(grids):
        one = torch.from_numpy(grid[None])
        n = int(grid.prod())
        order, cu_windows = vision_utils.get_vision_window_index(one, spatial_merge_size=2, window_size=16,
                                                                 patch_size=4)
        sizes = np.diff(cu_windows.numpy()) // cfg.merge_unit
        theirs = np.empty(n // cfg.merge_unit, np.int64)  # each merged token's window, in image order
        theirs[order.numpy()] = np.repeat(np.arange(len(sizes)), sizes)
        np.testing.assert_array_equal(windows[i, :n:cfg.merge_unit], theirs + 1)
        np.testing.assert_array_equal(positions[i, :n], vision_utils.get_vision_position_ids(one, 2).numpy())
        per_frame = np.diff(vision_utils.get_vision_cu_seqlens(one).numpy())
        np.testing.assert_array_equal(frames[i, :n], np.repeat(np.arange(1, len(per_frame) + 1), per_frame))


def padded(pixels: np.ndarray, grids: np.ndarray) -> np.ndarray:
    """The processor's concatenated patches as one [images, most patches, patch_dim] array, zeros past each."""
    sizes = grids.prod(-1)
    out = np.zeros((len(grids), sizes.max(), pixels.shape[1]), np.float32)
    for i, rows in enumerate(np.split(pixels, np.cumsum(sizes)[:-1])):
        out[i, :len(rows)] = rows
    return out


def unpadded(merged: jax.Array, grids: np.ndarray) -> jax.Array:
    """Each image's merged tokens, concatenated (transformers' `pooler_output`)."""
    return jnp.concatenate([merged[i, :n] for i, n in enumerate(grids.prod(-1) // 4)])


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory):
    """(directory, model): a tiny random Qwen2.5-VL in float32 saved by `save_pretrained`; weights ~ N(0, 1/fan_in),
    norm scales ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 1e4}),
        vision_config=VISION, image_token_id=IMAGE, video_token_id=91, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape)
            if "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise if name.endswith("bias") else noise / np.sqrt(p.shape[-1]))
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(directory)
    return directory, model


@pytest.mark.full
@pytest.mark.parametrize("count", [1, 3])
def test_vision_tower_equals_transformers(tiny_qwen_vl, count):
    """`padded_vision_forward` on the processor's patches of `count` images (windows cut through them) is
    `model.visual(pixel_values, grid_thw).pooler_output` to ~1e-5 relative, weights read from the checkpoint."""
    directory, model = tiny_qwen_vl
    cfg = vision_config_from_hf(json.loads((directory / "config.json").read_text()))
    images = [generated_images()[i] for i in (0, 4, 5)[:count]]
    pixels, grids = image_patches(images, QwenImageOptions(patch_size=4, min_pixels=16 * 16, max_pixels=48 * 64))
    assert (grids[:, 1:] // 2 % cfg.window_tokens).any()  # some windows cut short by an image's edge
    with torch.no_grad():
        expected = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids)).pooler_output
    params = read_vision_params(directory)
    merged = jax.jit(padded_vision_forward, static_argnums=3)(params, padded(pixels, grids), jnp.asarray(grids), cfg)
    got = np.asarray(unpadded(merged, grids))
    assert got.shape == (grids.prod(-1).sum() // 4, 24)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5 * np.abs(expected.numpy()).max())


@pytest.mark.full
def test_vision_tower_gradients_equal_transformers(tiny_qwen_vl, tmp_path):
    """The gradient of sum(embeddings²) over three images by every weight is torch's (its gradients written as a
    checkpoint and read back through `read_vision_params`, so they arrive in our layout), to 3e-5 relative."""
    directory, model = tiny_qwen_vl
    cfg = vision_config_from_hf(json.loads((directory / "config.json").read_text()))
    pixels, grids = image_patches([generated_images()[i] for i in (0, 4, 5)],
                                  QwenImageOptions(patch_size=4, min_pixels=16 * 16, max_pixels=48 * 64))
    model.zero_grad()
    (model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids)).pooler_output ** 2).sum().backward()
    grads = {f"visual.{name}": p.grad.numpy() for name, p in model.model.visual.named_parameters()}
    save_file(grads, tmp_path / "model.safetensors")
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    images = padded(pixels, grids)
    loss = lambda params: jnp.sum(unpadded(padded_vision_forward(params, images, jnp.asarray(grids), cfg), grids) ** 2)
    got = jax.jit(jax.grad(loss))(read_vision_params(directory))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5 * np.abs(b).max()), got,
                 read_vision_params(tmp_path))


@pytest.mark.full
def test_vision_weights_read_under_either_prefix(tiny_qwen_vl, tmp_path):
    """A checkpoint naming the tower `model.visual.` (transformers 5's module path) reads as one naming it
    `visual.` (the hub's); a tensor of the wrong shape is refused with its name."""
    directory, _ = tiny_qwen_vl
    tensors = load_file(directory / "model.safetensors")
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    save_file({f"model.{k}" if k.startswith("visual.") else k: v for k, v in tensors.items()},
              tmp_path / "model.safetensors")
    jax.tree.map(np.testing.assert_array_equal, read_vision_params(directory), read_vision_params(tmp_path))
    tensors["visual.blocks.1.attn.proj.bias"] = np.zeros(31, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(Exception, match=r"visual\.blocks\.1\.attn\.proj\.bias: shape \(31,\)"):
        read_vision_params(tmp_path)


def tokens(*parts) -> list[int]:
    """Text of n tokens for an int n, an image's bracketed placeholders for a (t, h, w) grid."""
    ids = []
    for part in parts:
        ids += ([VISION_START] + [IMAGE] * (int(np.prod(part)) // 4) + [VISION_END] if isinstance(part, tuple)
                else list(range(3, 3 + part)))
    return ids


@pytest.mark.full
def test_rope_index_equals_transformers(tiny_qwen_vl):
    """`image_placement`'s M-RoPE positions of rows with no image, one, and three (text between), left- and
    right-padded, equal `get_rope_index`'s at the real tokens; each row's largest + 1 minus its length is its delta."""
    _, model = tiny_qwen_vl
    grids = [(1, 4, 6), (1, 2, 2), (1, 8, 4), (1, 6, 6), (1, 4, 10)]
    rows = [tokens(3, grids[0], 5), tokens(7), tokens(4, grids[1], 1, grids[2], 2, grids[3], 3),
            tokens(grids[4], 2)]
    per_row = [[grids[0]], [], grids[1:4], [grids[4]]]
    T = max(map(len, rows)) + 2
    ids, mask = np.zeros((len(rows), T), np.int64), np.zeros((len(rows), T), np.int64)
    for b, row in enumerate(rows):
        start = 0 if b % 2 else T - len(row)
        ids[b, start:start + len(row)], mask[b, start:start + len(row)] = row, 1
    torch_ids = torch.from_numpy(ids)
    expected, deltas = model.model.get_rope_index(torch_ids, (torch_ids == IMAGE).int(), torch.from_numpy(
        np.array(grids)), attention_mask=torch.from_numpy(mask))
    images = np.zeros((len(rows), 3, 3), np.int64)
    for b, row_grids in enumerate(per_row):
        images[b, :len(row_grids)] = np.reshape(row_grids, (-1, 3))
    plain = np.maximum(np.cumsum(mask, 1) - 1, 0)
    _, _, got = jax.jit(image_placement, static_argnums=3)(jnp.asarray(ids == IMAGE), jnp.asarray(images),
                                                            jnp.asarray(plain), 2)
    got, real = np.asarray(got), mask > 0
    np.testing.assert_array_equal(got[:, real], expected.numpy()[:, real])
    np.testing.assert_array_equal(np.where(real, got, 0).max(axis=(0, 2)) + 1 - real.sum(1), deltas.numpy()[:, 0])


@pytest.mark.full
def test_mrope_equals_transformers(tiny_qwen_vl):
    """cos and sin of three position streams through `mrope_section`, and queries rotated by them, as the text
    model's rotary embedding and `apply_rotary_pos_emb` compute them."""
    _, model = tiny_qwen_vl
    ids = np.array([tokens(3, (1, 4, 6), 2, (1, 8, 4), 4)])
    positions = np.asarray(image_placement(jnp.asarray(ids == IMAGE), jnp.asarray([[[1, 4, 6], [1, 8, 4]]]),
                                           jnp.arange(ids.shape[1])[None], 2)[2])
    positions = positions + np.array([0, 50, 900])[:, None, None]  # streams far apart: a mixed-up one shows
    cos, sin = Qwen2_5_VLRotaryEmbedding(model.config.text_config)(torch.zeros(1), torch.from_numpy(positions))
    cfg = tiny_config(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e4,
                      mrope_section=tuple(MROPE_SECTION))
    got_cos, got_sin = mrope_angles(jnp.asarray(positions), cfg, jnp.float32)
    np.testing.assert_allclose(got_cos, cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(got_sin, sin.numpy(), atol=1e-6)
    q = np.random.RandomState(0).randn(1, 2, ids.shape[1], 16).astype(np.float32)  # [B, heads, T, head_dim]
    expected, _ = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    got = apply_rope(jnp.asarray(q.transpose(0, 2, 1, 3)), got_cos, got_sin)
    np.testing.assert_allclose(np.asarray(got).transpose(0, 2, 1, 3), expected.numpy(), atol=1e-5)
