"""Qwen2.5-VL's vision parts, torch-free: the processor's resize rule and patch order by hand, the padded window
layout and M-RoPE positions on small cases, and the tower's own invariants (padding changes nothing; windows
matter). Their agreement with transformers is test_vision_qwen_vl_parity.py's."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxtune.errors import JaxtuneError
from jaxtune.models.rope import mrope_streams
from jaxtune.models.vision.qwen2_5_vl import image_placement
from jaxtune.models.vision.qwen_vl_config import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    QwenImageOptions,
    QwenVisionConfig,
    image_options_from_hf,
    vision_config_from_hf,
)
from jaxtune.models.vision.qwen_vl_processor import image_patches, patches, smart_resize
from jaxtune.models.vision.qwen_vl_vision import (
    PAD_SEGMENT,
    abstract_vision_params,
    padded_layout,
    padded_vision_forward,
)

# 4 x 4-pixel patches, windows of 2 x 2 merged tokens (16 pixels), block 2 attending over whole images
TINY_VISION = QwenVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24,
                               patch_size=4, window_size=16, fullatt_blocks=(2,))


def test_smart_resize_by_hand():
    """Sides rounded to multiples of 28; an area past max_pixels scaled down, one under min_pixels up."""
    assert smart_resize(60, 100) == (56, 112)  # 2.1 and 3.6 factors round to 2 and 4
    assert smart_resize(1000, 2000, max_pixels=28 * 28 * 100) == (196, 392)  # beta = sqrt(2e6 / 78400)
    assert smart_resize(10, 20) == (56, 84)  # beta = sqrt(3136 / 200): ceil(1.41), ceil(2.83) factors
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


def test_window_layout_by_hand():
    """A 2 x 4 merged grid in windows of 2 x 2 merged tokens: merged tokens 0, 1, 4, 5 in window 1, 2, 3, 6, 7 in
    window 2 (each merged token's 4 patches together); merged token 4's patches at rows 2-3, columns 0-1; the slots
    past the image's 32 patches padding; a two-frame image's frames apart."""
    layout = jax.jit(padded_layout, static_argnums=(1, 2))
    positions, windows, images = layout(jnp.asarray([[1, 4, 8], [2, 2, 2]]), 36, TINY_VISION)
    assert windows[0].tolist() == np.repeat([1, 1, 2, 2, 1, 1, 2, 2], 4).tolist() + [PAD_SEGMENT] * 4
    assert positions[0, 16:20].tolist() == [[2, 0], [2, 1], [3, 0], [3, 1]]
    assert images[1].tolist() == [1] * 4 + [2] * 4 + [PAD_SEGMENT] * 28 and windows[1, :8].tolist() == [1] * 4 + [2] * 4


def placement(ids, grids, plain=None):
    """`image_placement`'s positions [3, T] of one row of image token 1."""
    ids = np.asarray([ids])
    plain = np.arange(ids.shape[1])[None] if plain is None else np.asarray([plain])
    run = jax.jit(image_placement, static_argnums=3)
    return np.asarray(run(jnp.asarray(ids == 1), jnp.asarray([grids]), jnp.asarray(plain), 2)[2])[:, 0]


def test_mrope_positions_by_hand():
    """Text counts on in all three streams; a 4 x 4-patch image (2 x 2 merged) starting at 3 takes (3, 3 + row,
    3 + column); the text after it resumes at 3 + 2; a second example packed after restarts at 0."""
    assert placement([5, 6, 7, 1, 1, 1, 1, 8, 9], [[1, 4, 4]]).tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 5, 6], [0, 1, 2, 3, 3, 4, 4, 5, 6], [0, 1, 2, 3, 4, 3, 4, 5, 6]]
    packed = placement([5, 1, 1, 1, 1, 8, 7, 1, 1, 1, 1, 9], [[1, 4, 4], [1, 4, 4]], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3,
                                                                                         4, 5])
    assert packed[2].tolist() == [0, 1, 2, 1, 2, 3] * 2
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


def test_padding_changes_nothing_and_windows_matter():
    """An image padded to more patch slots, beside another, gives what it gives in exactly its own; attending over
    whole images in every block instead of windows changes the output."""
    cfg, params = TINY_VISION, random_vision_params(TINY_VISION)
    forward = jax.jit(padded_vision_forward, static_argnums=3)
    pixels = np.random.RandomState(1).randn(2, 112, cfg.patch_dim).astype(np.float32)
    pixels[:, 96:], pixels[1, 16:] = 0, 0
    grids = jnp.asarray([[1, 8, 12], [1, 4, 4]])
    both = forward(params, jnp.asarray(pixels), grids, cfg)
    first = forward(params, jnp.asarray(pixels[:1, :96]), grids[:1], cfg)
    np.testing.assert_allclose(both[0, :24], first[0], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(both)).all()
    full = QwenVisionConfig(**{**cfg.__dict__, "fullatt_blocks": (0, 1, 2)})
    assert np.abs(forward(params, jnp.asarray(pixels[:1, :96]), grids[:1], full) - first).max() > 1e-2


# Qwen2.5-VL-7B-Instruct's config.json, its vision part as the hub writes it (`in_chans`, `spatial_patch_size`)
QWEN2_5_VL_7B = {"model_type": "qwen2_5_vl", "vision_config": {
    "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
    "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}


def test_the_7b_tower_traces_to_its_shape():
    """The hub's 7B vision config reads, and its tower traces (`jax.eval_shape`, nothing allocated) from two images
    padded to the released patch budget to one 3584-wide embedding per merged token; Qwen2-VL's is refused."""
    cfg = vision_config_from_hf(QWEN2_5_VL_7B)
    assert (cfg.head_dim, cfg.window_tokens, cfg.patch_dim, cfg.fullatt_blocks) == (80, 4, 1176, (7, 15, 23, 31))
    N = 12845056 // 14**2  # the released max_pixels' budget a padded image
    out = jax.eval_shape(partial(padded_vision_forward, cfg=cfg), abstract_vision_params(cfg, jnp.bfloat16),
                         jax.ShapeDtypeStruct((2, N, cfg.patch_dim), jnp.float32),
                         jax.ShapeDtypeStruct((2, 3), jnp.int32))
    assert (out.shape, out.dtype) == ((2, N // 4, 3584), jnp.bfloat16)
    with pytest.raises(JaxtuneError, match="model_type 'qwen2_vl'"):
        vision_config_from_hf({**QWEN2_5_VL_7B, "model_type": "qwen2_vl"})
