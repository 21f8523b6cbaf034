"""Qwen2.5-VL's vision parts, torch-free: the processor's resize rule, patch order and placeholders by hand, the
window layout and M-RoPE positions on small cases, and the tower's own invariants (images do not see each other;
windows matter). Their agreement with transformers is test_vision_qwen_vl_parity.py's."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxtune.errors import JaxtuneError
from jaxtune.models.rope import mrope_streams
from jaxtune.models.vision.mrope import rope_index
from jaxtune.models.vision.qwen_vl_config import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    QwenImageOptions,
    QwenVisionConfig,
    image_options_from_hf,
    vision_config_from_hf,
)
from jaxtune.models.vision.qwen_vl_layout import vision_layout, window_index
from jaxtune.models.vision.qwen_vl_processor import (
    IMAGE_PAD,
    expand_image_placeholders,
    image_grid,
    image_patches,
    image_token_count,
    patches,
    smart_resize,
)
from jaxtune.models.vision.qwen_vl_vision import abstract_vision_params, vision_forward

# 4 x 4-pixel patches, windows of 2 x 2 merged tokens (16 pixels), block 2 attending over whole images
TINY_VISION = QwenVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24,
                               patch_size=4, window_size=16, fullatt_blocks=(2,))


def test_smart_resize_by_hand():
    """Sides rounded to multiples of 28; an area past max_pixels scaled down, one under min_pixels up."""
    assert smart_resize(60, 100) == (56, 112)  # 2.1 and 3.6 factors round to 2 and 4
    assert smart_resize(1000, 2000, max_pixels=28 * 28 * 100) == (196, 392)  # beta = sqrt(2e6 / 78400)
    assert smart_resize(10, 20) == (56, 84)  # beta = sqrt(3136 / 200): ceil(1.41), ceil(2.83) factors
    assert image_token_count(60, 100, QwenImageOptions()) == 8  # a 4 x 8 patch grid, 2 x 2 merged
    with pytest.raises(JaxtuneError, match="aspect ratio"):
        smart_resize(10, 2100)


def test_patch_order_by_hand():
    """Patch k is merge block k // 4 (blocks row by row), its (k % 4)-th patch row by row; its values channel,
    frame (the image twice), pixel row, pixel column."""
    options = QwenImageOptions(patch_size=2, merge_size=2, temporal_patch_size=2)
    image = np.arange(3 * 4 * 8, dtype=np.float32).reshape(3, 4, 8)  # a 2 x 4 grid of patches, 1 x 2 merged blocks
    got = patches(image, options)
    expected = []
    for block_col in range(2):
        for in_row in range(2):
            for in_col in range(2):
                r, c = 2 * in_row, 2 * (2 * block_col + in_col)
                piece = image[:, r:r + 2, c:c + 2]
                expected.append(np.stack([piece, piece], axis=1).reshape(-1))
    np.testing.assert_array_equal(got, np.stack(expected))


def test_image_patches_of_an_image_already_on_the_grid():
    """An image whose sides are multiples of 28 is not resized: (x / 255 - mean) / std, RGBA over white, grayscale
    on all three channels."""
    rng = np.random.RandomState(0)
    rgb, gray = rng.randint(0, 256, (56, 84, 3), np.uint8), rng.randint(0, 256, (56, 56), np.uint8)
    clear = np.zeros((56, 56, 4), np.uint8)  # fully transparent: white
    values, grids = image_patches([Image.fromarray(rgb), Image.fromarray(clear, "RGBA"), Image.fromarray(gray)])
    assert grids.tolist() == [[1, 4, 6], [1, 4, 4], [1, 4, 4]]
    mean, std = np.float32(OPENAI_CLIP_MEAN), np.float32(OPENAI_CLIP_STD)
    options = QwenImageOptions()
    for pixels, rows in ((rgb, slice(0, 24)), (np.full((56, 56, 3), 255, np.uint8), slice(24, 40)),
                         (np.repeat(gray[..., None], 3, -1), slice(40, 56))):
        normalized = ((pixels.astype(np.float64) / 255).astype(np.float32) - mean) / std
        np.testing.assert_allclose(values[rows], patches(normalized.transpose(2, 0, 1), options), rtol=1e-6)


def test_image_options_read_old_and_new_preprocessor_configs():
    """Top-level min_pixels and max_pixels (the hub's Qwen2.5-VL files) win over `size`; a processor that skips a
    step jaxtune always takes is refused."""
    old = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    assert image_options_from_hf(old) == QwenImageOptions(max_pixels=12845056)
    new = {"size": {"shortest_edge": 1024, "longest_edge": 4096}, "resample": 3}
    assert image_options_from_hf(new) == QwenImageOptions(min_pixels=1024, max_pixels=4096)
    with pytest.raises(JaxtuneError, match="resample 2"):
        image_options_from_hf({"resample": 2})
    with pytest.raises(JaxtuneError, match="always does"):
        image_options_from_hf({"do_convert_rgb": False})


def test_placeholders_expand_in_order_across_texts():
    texts = ["a" + IMAGE_PAD + "b", IMAGE_PAD + " and " + IMAGE_PAD]
    assert expand_image_placeholders(texts, [2, 1, 3]) == ["a" + IMAGE_PAD * 2 + "b",
                                                           IMAGE_PAD + " and " + IMAGE_PAD * 3]
    with pytest.raises(JaxtuneError, match="3 <|image_pad|> placeholders"):
        expand_image_placeholders(texts, [2, 1])


def test_window_layout_by_hand():
    """A 2 x 4 merged grid in windows of 2 x 2 merged tokens: tokens 0, 1, 4, 5 then 2, 3, 6, 7; a second image's
    tokens after the first's, in windows of their own; each merged token's patches kept together."""
    merged_index, window_of = window_index(np.array([[1, 4, 8], [1, 2, 2]]), TINY_VISION)
    assert merged_index.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8]
    assert window_of.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    layout = vision_layout(np.array([[1, 4, 8], [1, 2, 2]]), TINY_VISION)
    assert layout.patch_order_N[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # merged tokens 0 and 1
    assert layout.patch_order_N[8:12].tolist() == [16, 17, 18, 19]  # merged token 4
    assert (merged_index[layout.merged_order_M] == np.arange(9)).all()
    assert layout.image_segment_N.tolist() == [1] * 32 + [2] * 4
    assert layout.positions_Nx2[8:12].tolist() == [[2, 0], [2, 1], [3, 0], [3, 1]]  # merged token 4: rows 2-3


def test_rope_index_by_hand():
    """Text counts on in all three streams; a 4 x 4-patch image (2 x 2 merged) starting at 3 takes (3, 3 + row,
    3 + column); the text after it resumes at 3 + 2."""
    ids = np.array([[5, 6, 7, 1, 1, 1, 1, 8, 9]])  # image token 1
    positions, deltas = rope_index(ids, np.array([[1, 4, 4]]), image_token_id=1, spatial_merge_size=2)
    assert positions[:, 0].tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6], [0, 1, 2, 3, 3, 4, 4, 5, 6],
                                        [0, 1, 2, 3, 4, 3, 4, 5, 6]]
    assert deltas.tolist() == [[-2]]
    with pytest.raises(JaxtuneError, match="takes 4 image tokens"):
        rope_index(ids[:, :5], np.array([[1, 4, 4]]), image_token_id=1, spatial_merge_size=2)
    assert mrope_streams((1, 2, 1), 8).tolist() == [0, 1, 1, 2, 0, 1, 1, 2]


def random_vision_params(cfg: QwenVisionConfig, seed: int = 0) -> dict:
    """Kernels ~ N(0, 1 / fan_in), norm scales ~ 1 + N(0, 0.1), biases ~ N(0, 0.1), drawn with numpy."""
    rng = np.random.RandomState(seed)

    def draw(path, spec):
        name = jax.tree_util.keystr(path)
        noise = rng.randn(*spec.shape).astype(np.float32)
        if "norm" in name:
            return 1 + 0.1 * noise
        return noise / np.sqrt(spec.shape[-2]) if "kernel" in name else 0.1 * noise
    return jax.tree_util.tree_map_with_path(draw, abstract_vision_params(TINY_VISION))


def test_images_do_not_see_each_other_and_windows_matter():
    """Two images through the tower together give what each gives alone; attending over whole images in every
    block instead of windows changes the output."""
    cfg, params = TINY_VISION, random_vision_params(TINY_VISION)
    forward = jax.jit(vision_forward, static_argnums=3)
    grids = np.array([[1, 8, 12], [1, 4, 4]])
    pixels = np.random.RandomState(1).randn(112, cfg.patch_dim).astype(np.float32)
    both = forward(params, pixels, vision_layout(grids, cfg), cfg)
    first = forward(params, pixels[:96], vision_layout(grids[:1], cfg), cfg)
    second = forward(params, pixels[96:], vision_layout(grids[1:], cfg), cfg)
    np.testing.assert_allclose(both, jnp.concatenate([first, second]), rtol=1e-5, atol=1e-5)
    full = QwenVisionConfig(**{**cfg.__dict__, "fullatt_blocks": (0, 1, 2)})
    assert np.abs(forward(params, pixels[:96], vision_layout(grids[:1], full), full) - first).max() > 1e-2


# Qwen2.5-VL-7B-Instruct's config.json, its vision part as the hub writes it (`in_chans`, `spatial_patch_size`)
QWEN2_5_VL_7B = {"model_type": "qwen2_5_vl", "vision_config": {
    "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
    "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}


def test_the_7b_tower_traces_to_its_shape():
    """The hub's 7B vision config reads, and its tower traces (`jax.eval_shape`, nothing allocated) from a
    processor's patches of two images to one 3584-wide embedding per merged token; Qwen2-VL's is refused."""
    cfg = vision_config_from_hf(QWEN2_5_VL_7B)
    assert (cfg.head_dim, cfg.window_tokens, cfg.patch_dim, cfg.fullatt_blocks) == (80, 4, 1176, (7, 15, 23, 31))
    grids = np.array([image_grid(480, 640, QwenImageOptions()), image_grid(1000, 300, QwenImageOptions())])
    N = int(grids.prod(-1).sum())
    out = jax.eval_shape(partial(vision_forward, cfg=cfg), abstract_vision_params(cfg, jnp.bfloat16),
                         jax.ShapeDtypeStruct((N, cfg.patch_dim), jnp.float32), vision_layout(grids, cfg))
    assert (out.shape, out.dtype) == ((N // 4, 3584), jnp.bfloat16)
    with pytest.raises(JaxtuneError, match="model_type 'qwen2_vl'"):
        vision_config_from_hf({**QWEN2_5_VL_7B, "model_type": "qwen2_vl"})
