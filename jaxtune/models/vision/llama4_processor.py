"""Llama 4's image preprocessing without torch (transformers' `Llama4ImageProcessor`, step for step in numpy and
Pillow): an image is fitted without distortion onto the best canvas of whole tiles (at most `max_patches` of them),
padded at its bottom and right, cut into tiles row by row, and, when it takes more than one tile, followed by a
global tile (the whole image resized to one tile); rescaling and normalisation round through bfloat16 as
transformers' does. `image_tiles` gives each tile one pixel array [3, S, S] and each image its tile grid."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from PIL import Image

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.models.vision.image_processing import PREPROCESSOR_FILE, rgb_array


@dataclass(frozen=True, kw_only=True)
class Llama4ImageOptions:
    """`preprocessor_config.json` of a Llama 4 model: tiles of `tile_size` pixels a side, at most `max_patches`
    tiles an image (the global tile besides), Pillow's filter `resample` (2: bilinear), `resize_to_max_canvas`
    (upscale onto the largest canvas rather than the smallest that holds the image)."""

    tile_size: int = 336
    max_patches: int = 16
    resample: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resize_to_max_canvas: bool = False


def read_options(directory: str | Path) -> Llama4ImageOptions:
    """The options of a model directory's preprocessor_config.json (absent keys: the processor's defaults)."""
    path = Path(directory) / PREPROCESSOR_FILE
    hf = read_json(path) if path.is_file() else {}
    size = hf.get("size") or {"height": 336, "width": 336}
    if size.get("height") is None or size.get("height") != size.get("width"):
        raise JaxtuneError(f"{path}: size {size}: Llama 4's tiles are square (height = width)")
    given = {key: hf[key] for key in ("max_patches", "resample", "rescale_factor", "resize_to_max_canvas")
             if hf.get(key) is not None}
    given.update({key: tuple(map(float, hf[key])) for key in ("image_mean", "image_std") if hf.get(key) is not None})
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if hf.get(key) is False:
            raise JaxtuneError(f"{path}: {key} = false is not supported (Llama 4's processor resizes, rescales, "
                               "normalises and converts to RGB)")
    return Llama4ImageOptions(tile_size=int(size["height"]), **given)


def canvases(max_tiles: int, tile: int) -> np.ndarray:
    """[R, 2] the canvases (height, width) in pixels of every grid of at most `max_tiles` tiles, in transformers'
    order (`find_supported_resolutions`: by tile count down, grouped by aspect ratio as first seen)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted({d for i in range(1, math.isqrt(count) + 1) if count % i == 0 for d in (i, count // i)}):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return np.array([(h * tile, w * tile) for grids in by_ratio.values() for h, w in grids], np.int64)


def best_canvas(height: int, width: int, options: Llama4ImageOptions) -> tuple[int, int]:
    """The canvas an image of height x width goes onto (`get_best_fit`): the least upscaling without distortion,
    else the least downscaling; of equal scales the smallest area. Scales in float32, as torch divides."""
    possible = canvases(options.max_patches, options.tile_size)
    scales = np.minimum(possible[:, 0].astype(np.float32) / np.float32(height),
                        possible[:, 1].astype(np.float32) / np.float32(width))
    up = scales[scales >= 1]
    chosen = (up.max() if options.resize_to_max_canvas else up.min()) if len(up) else scales[scales < 1].max()
    fits = possible[scales == chosen]
    return tuple(int(v) for v in fits[np.argmin(fits[:, 0] * fits[:, 1])])  # type: ignore[return-value]


def fitted_size(height: int, width: int, canvas: tuple[int, int], options: Llama4ImageOptions) -> tuple[int, int]:
    """The size the image is resized to inside its canvas (`get_max_res_without_distortion`), never upscaled past
    max(side, tile) unless `resize_to_max_canvas`. A bound that is the canvas's own side divides in float32 (it
    is a torch value there), one that is the image's side or the tile's in float64 (a Python int)."""
    bounds = [(c, True) if options.resize_to_max_canvas or c < max(s, options.tile_size) else
              (max(s, options.tile_size), False) for c, s in zip(canvas, (height, width))]
    (bound_h, tensor_h), (bound_w, tensor_w) = bounds
    real = lambda tensor: np.float32 if tensor else np.float64  # noqa: E731
    scale_h = real(tensor_h)(bound_h) / real(tensor_h)(height)
    scale_w = real(tensor_w)(bound_w) / real(tensor_w)(width)
    if scale_w < scale_h:
        new_h, new_w = min(math.floor(real(tensor_w)(height) * scale_w), bound_h), bound_w
    else:
        new_h, new_w = bound_h, min(math.floor(real(tensor_h)(width) * scale_h), bound_w)
    return max(int(new_h), 1), max(int(new_w), 1)


def normalized(image_CxHxW: np.ndarray, options: Llama4ImageOptions) -> np.ndarray:
    """uint8 [C, H, W] -> float32 [C, H, W]: x * rescale_factor, minus the mean, over the std, each op's result
    rounded to bfloat16 (transformers computes them in bfloat16)."""
    bf16 = ml_dtypes.bfloat16
    to_bf16 = lambda x: np.asarray(x, np.float32).astype(bf16).astype(np.float32)  # noqa: E731
    mean, std = (to_bf16(np.asarray(v))[:, None, None] for v in (options.image_mean, options.image_std))
    x = to_bf16(image_CxHxW.astype(np.float32) * np.float32(options.rescale_factor))
    return to_bf16(to_bf16(x - mean) / std)


def _resized(image_CxHxW: np.ndarray, height: int, width: int, options: Llama4ImageOptions) -> np.ndarray:
    pil = Image.fromarray(np.moveaxis(image_CxHxW, 0, -1))
    return np.moveaxis(np.array(pil.resize((width, height), resample=Image.Resampling(options.resample))), -1, 0)


def image_tiles(images: Sequence[Image.Image], options: Llama4ImageOptions
                ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(float32 [N, 3, S, S]: each image's tiles row by row, then its global tile if it has more than one; each
    image's tile grid (rows, columns))."""
    tiles: list[np.ndarray] = []
    grids = []
    S = options.tile_size
    for image in images:
        array = rgb_array(image)
        _, height, width = array.shape
        canvas = best_canvas(height, width, options)
        new_h, new_w = fitted_size(height, width, canvas, options)
        padded: np.ndarray = np.zeros((3, *canvas), np.uint8)
        padded[:, :new_h, :new_w] = _resized(array, new_h, new_w, options)
        rows, cols = canvas[0] // S, canvas[1] // S
        values = normalized(padded, options).reshape(3, rows, S, cols, S)
        tiles += list(np.transpose(values, (1, 3, 0, 2, 4)).reshape(rows * cols, 3, S, S))
        if rows * cols > 1:
            tiles.append(normalized(_resized(array, S, S, options), options))
        grids.append((rows, cols))
    return np.stack(tiles), grids
