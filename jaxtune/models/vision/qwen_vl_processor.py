"""Qwen2-VL's image processor in numpy + Pillow, step for step as transformers' `Qwen2VLImageProcessorPil`: RGB
(transparency over white), `smart_resize`d with Pillow's bicubic filter, scaled, normalised, then cut into patches
in merge-block order (`image_patches`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.qwen_vl_config import QwenImageOptions


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """(height, width) each a multiple of `factor`, the area within [min_pixels, max_pixels], the aspect ratio kept
    as closely as that allows (Qwen2-VL's `smart_resize`, its float arithmetic as written)."""
    if max(height, width) / min(height, width) > 200:
        raise JaxtuneError(f"an image of {height} x {width}: the aspect ratio must be at most 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3]: the image in RGB, a transparent one composited over white (transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))


def normalized_image(image: Image.Image, options: QwenImageOptions) -> np.ndarray:
    """float32 [3, H', W']: resized (bicubic, to `smart_resize`'s size), scaled by rescale_factor in float64 and
    rounded to float32, then (x - mean) / std in float32, as the PIL processor rounds."""
    pixels = rgb_pixels(image)
    h, w = smart_resize(pixels.shape[0], pixels.shape[1], options.factor, options.min_pixels, options.max_pixels)
    resized = np.asarray(Image.fromarray(pixels).resize((w, h), resample=Image.Resampling.BICUBIC))
    scaled = (resized.astype(np.float64) * options.rescale_factor).astype(np.float32)
    mean, std = np.asarray(options.mean, np.float32), np.asarray(options.std, np.float32)
    return ((scaled - mean) / std).transpose(2, 0, 1)


def patches(image_CxHxW: np.ndarray, options: QwenImageOptions) -> np.ndarray:
    """float32 [h * w, C * temporal_patch_size * patch²]: an image's patches, each merge_size x merge_size block
    of them consecutive (blocks in row order, patches in row order within a block), each patch's values in
    (channel, frame, row, column) order with the image repeated over temporal_patch_size frames."""
    C, H, W = image_CxHxW.shape
    p, m, tp = options.patch_size, options.merge_size, options.temporal_patch_size
    h, w = H // p, W // p
    blocks = image_CxHxW.reshape(C, h // m, m, p, w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    return frames.reshape(h * w, C * tp * p * p)


def image_patches(images: Sequence[Image.Image], options: QwenImageOptions = QwenImageOptions()
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values float32 [N, C * temporal_patch_size * patch²], image_grid_thw int64 [images, 3]): the images'
    patches one after another, as `Qwen2VLImageProcessor(images)` gives them."""
    if not images:
        raise JaxtuneError("image_patches: no images")
    values, grids = [], []
    for image in images:
        pixels = normalized_image(image, options)
        values.append(patches(pixels, options))
        grids.append((1, pixels.shape[1] // options.patch_size, pixels.shape[2] // options.patch_size))
    return np.concatenate(values), np.asarray(grids, np.int64)
