"""The image side of a vision-language model: its SigLIP tower and how its images become text tokens (Gemma 3)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SiglipConfig:
    """A SigLIP vision tower (transformers' `SiglipVisionConfig`, no pooling head): square images of `image_size`
    pixels cut into patches of `patch_size`, each embedded (a convolution of stride `patch_size`) plus its learned
    position; `num_layers` pre-norm encoder layers of bidirectional attention (`num_heads`) and a tanh-GELU MLP
    of `intermediate_size`; a final LayerNorm."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class VisionLanguageConfig:
    """Gemma 3's image path (`Gemma3Config` beside its `text_config`): the tower's patch grid average-pooled to
    `tokens_per_image` soft tokens (a square grid), Gemma-RMSNormed and projected to the text's `text_hidden_size`;
    they replace the `image_token_id` placeholders of the text (which the processor wraps in `boi_token_id` and
    `eoi_token_id`), one bidirectional span an image."""

    tower: SiglipConfig
    text_hidden_size: int
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    def __post_init__(self):
        side = math.isqrt(self.tokens_per_image)
        if side * side != self.tokens_per_image or self.tower.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {self.tokens_per_image}: not a square grid dividing the tower's "
                             f"{self.tower.patches_per_side} x {self.tower.patches_per_side} patches")

    @property
    def pooling(self) -> int:
        """Patches per side of the square each soft token averages."""
        return self.tower.patches_per_side // math.isqrt(self.tokens_per_image)


@dataclass(frozen=True, kw_only=True)
class ImageProcessingConfig:
    """Gemma 3's image processor (`preprocessor_config.json`): each image to RGB (transparency composited onto
    white), resized to `height` x `width` with Pillow's filter `resample` (2: bilinear), times `rescale_factor`,
    normalised by `image_mean` and `image_std` per channel. `pan_and_scan`: also crops of a wide or tall image
    (at least `pan_and_scan_min_ratio_to_activate` to 1), up to `pan_and_scan_max_num_crops` of at least
    `pan_and_scan_min_crop_size` pixels a side, each processed as an image after the whole one."""

    height: int
    width: int
    resample: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    convert_rgb: bool = True
    resize: bool = True
    rescale: bool = True
    normalize: bool = True
    pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
