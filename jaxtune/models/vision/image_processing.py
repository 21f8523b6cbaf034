"""Gemma 3's image preprocessing without torch (transformers' `Gemma3ImageProcessorPil`, step for step in numpy and
Pillow, so the pixel values are its own): `read_image_processing` (`preprocessor_config.json`) and `pixel_values`
(PIL images -> [N, C, H, W] float32, with pan-and-scan's crops where configured)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from jaxtune.config.vision import ImageProcessingConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json

PREPROCESSOR_FILE = "preprocessor_config.json"


def read_image_processing(directory: str | Path) -> ImageProcessingConfig:
    """The image processing of a model directory's `preprocessor_config.json` (its keys as transformers writes
    them; absent ones take the processor's defaults)."""
    path = Path(directory) / PREPROCESSOR_FILE
    if not path.is_file():
        raise JaxtuneError(f"{directory}: no {PREPROCESSOR_FILE} (the image processor's settings)")
    hf = read_json(path)
    size = hf.get("size") or {"height": 224, "width": 224}
    if "height" not in size or "width" not in size:
        raise JaxtuneError(f"{path}: size {size}: Gemma 3's processor resizes to a height and width")
    given = {key: hf[name] for key, name in (
        ("resample", "resample"), ("rescale_factor", "rescale_factor"), ("convert_rgb", "do_convert_rgb"),
        ("resize", "do_resize"), ("rescale", "do_rescale"), ("normalize", "do_normalize"),
        ("pan_and_scan", "do_pan_and_scan"), ("pan_and_scan_min_crop_size", "pan_and_scan_min_crop_size"),
        ("pan_and_scan_max_num_crops", "pan_and_scan_max_num_crops"),
        ("pan_and_scan_min_ratio_to_activate", "pan_and_scan_min_ratio_to_activate")) if hf.get(name) is not None}
    given.update({key: tuple(map(float, hf[key])) for key in ("image_mean", "image_std") if hf.get(key) is not None})
    return ImageProcessingConfig(height=int(size["height"]), width=int(size["width"]), **given)


def rgb_array(image: Image.Image) -> np.ndarray:
    """uint8 [3, H, W]: an image with transparency (an alpha band, or a palette's transparent colour) composited
    onto white, any other converted to RGB (transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.moveaxis(np.array(image.convert("RGB")), -1, 0)


def crops(image_CxHxW: np.ndarray, cfg: ImageProcessingConfig) -> list[np.ndarray]:
    """Pan-and-scan's crops of a wide (or tall) image: about its aspect ratio many (2 .. max) equal crops side by
    side (or stacked), none if the image is squarer than the threshold or a crop would be under the minimum size."""
    _, height, width = image_CxHxW.shape
    long, short = max(width, height), min(width, height)
    if long / short < cfg.pan_and_scan_min_ratio_to_activate:
        return []
    count = min(int(math.floor(long / cfg.pan_and_scan_min_crop_size)), int(math.floor(long / short + 0.5)))
    count = min(cfg.pan_and_scan_max_num_crops, max(2, count))
    across, down = (count, 1) if width >= height else (1, count)
    crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
    if min(crop_w, crop_h) < cfg.pan_and_scan_min_crop_size:
        return []
    return [image_CxHxW[:, y:y + crop_h, x:x + crop_w]
            for y, x in itertools.product(range(0, crop_h * down, crop_h), range(0, crop_w * across, crop_w))]


def processed(image_CxHxW: np.ndarray, cfg: ImageProcessingConfig) -> np.ndarray:
    """One uint8 image [C, H, W] resized, rescaled, normalised: float32 [C, height, width] (float32 as soon as
    rescaled: the product in float64, then rounded once; the normalisation in float32)."""
    image = image_CxHxW
    if cfg.resize:
        pil = Image.fromarray(image[0] if image.shape[0] == 1 else np.moveaxis(image, 0, -1))
        resized = np.array(pil.resize((cfg.width, cfg.height), resample=Image.Resampling(cfg.resample)))
        image = resized[None] if resized.ndim == 2 else np.moveaxis(resized, -1, 0)
    if cfg.rescale:
        image = (image.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.normalize:
        image = image if np.issubdtype(image.dtype, np.floating) else image.astype(np.float32)
        mean, std = (np.asarray(v, image.dtype)[:, None, None] for v in (cfg.image_mean, cfg.image_std))
        image = (image - mean) / std
    return image.astype(np.float32)


def pixel_values(images: Sequence[Image.Image], cfg: ImageProcessingConfig) -> tuple[np.ndarray, list[int]]:
    """(float32 [N, C, height, width], each image's number of crops): the images in order, each followed by its
    pan-and-scan crops (none without `cfg.pan_and_scan`)."""
    out: list[np.ndarray] = []
    counts = []
    for image in images:
        array = rgb_array(image) if cfg.convert_rgb else np.array(image)
        array = array[None] if array.ndim == 2 else array if cfg.convert_rgb else np.moveaxis(array, -1, 0)
        pieces = crops(array, cfg) if cfg.pan_and_scan else []
        counts.append(len(pieces))
        out += [processed(piece, cfg) for piece in [array, *pieces]]
    return np.stack(out), counts
