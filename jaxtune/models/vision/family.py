"""A vision family, one registered unit per vision-language architecture (`families.py` registers them): how its
directory's image side is read, how its processor turns images into pixel arrays and each image's chat-template
marker into the placeholder text the model reads (the number of text tokens an image takes is known from its
pixels before anything is tokenised), how its images enter the shared decoder (`image_inputs`), and which of its
parts may train (`VisionPart`). Data, the step, export and generation ask the unit; none of them names a family."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from PIL import Image


@dataclass(frozen=True, kw_only=True)
class VisionPart:
    """A part of the image side `[method] vision_modules` may train, named by its module path in transformers' model
    (less `model.`): `vision_tower`, `visual`.

    keys      the top-level keys of the image-side tree it holds (`kind = "full"` trains all their leaves)
    linears   {dict path of a linear module in the image-side tree: its transformers path, `{i}` the layer of a stacked
              one}: the modules LoRA adapts; a part without any (a projector) trains whole beside an adapter
              (PEFT's `modules_to_save`)
    saved     the module path PEFT's `modules_to_save` names a part trained whole by, and its tensors' prefix
    """

    keys: tuple[str, ...]
    linears: Mapping[tuple[str, ...], str] = field(default_factory=dict)
    saved: str = ""


@dataclass(frozen=True, kw_only=True)
class VisionFamily:
    """One vision-language architecture.

    name, architectures   its name and the `config.json` architectures it reads
    read_config           directory -> its image-side config (`VisionLanguageConfig`, `QwenVLConfig`, `Qwen3VLConfig`)
    param_specs           image-side config -> its tree as `ParamSpec`s; read_params(directory, config, dtype)
    tensor_entries        (image-side params, config, dtype) -> `write_weights` entries under canonical names
    read_processing       directory -> its image processor's settings
    pixels                (PIL images, processing) -> (float32 [N, *pixel_shape], per image what `expansion` takes:
                          Gemma 3 its pixel arrays, Qwen2.5-VL its placeholder tokens,
                          Llama 4 its tile grid)
    pixel_shape           processing -> one pixel array's shape (a batch's static shape)
    marker                (tokenizer, config) -> the text its chat template writes for an image part
    expansion             (tokenizer, config, that value of the image) -> the text the processor puts for that marker
    image_token           config -> the soft-token placeholder id (a run of them an array, in pixel order)
    image_inputs          (vision params, tokens [B, T], pixel arrays [B, M, ...] or [N, ...], each example's plain
                          positions [B, T] or None, cfg, config, dtype) -> (the tokens the text embeds, the decoder's
                          keyword arguments, `positions_BxT` among them); traceable, inside the one jitted step
    forward, prefill      (params, vision params, tokens [B, T], pixel arrays [N, ...], cfg, config, **llama's keywords)
                          -> the whole model's logits [B, T, V]; `kv_cache.prefill`'s (logits [B, V], cache)
    text_prefix           the text model's tensor prefix in its VLM checkpoint (PEFT's and the merged export's)
    outside_text          a regex of the VLM's module paths outside the text model (an adapter's exclude_modules)
    forward_bytes         (config, pixel_shape, pixel arrays, compute itemsize) -> bytes one forward of the image side
                          holds at its peak (the planner's); a family with `parts` also takes saved=True: of a
                          trained tower, every layer's input kept for the backward beside them
    image_spans           its image tokens attend each other both ways (`image_inputs` gives `span_ids_BxT`): the
                          decoder then runs the blockwise kernel, no fused one (`kernels.choose_kernel`)
    parts                 {name: `VisionPart`}: what `[method] vision_modules` may name, in the model's order (none:
                          the image side stays frozen)
    """

    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[str | Path], Any]
    param_specs: Callable[[Any], dict]
    read_params: Callable[..., dict]
    tensor_entries: Callable[..., list[tuple]]
    read_processing: Callable[[str | Path], Any]
    pixels: Callable[[Sequence[Image.Image], Any], tuple[np.ndarray, list]]
    pixel_shape: Callable[[Any], tuple[int, ...]]
    marker: Callable[[Any, Any], str]
    expansion: Callable[[Any, Any, Any], str]
    image_token: Callable[[Any], int]
    image_inputs: Callable[..., tuple]
    forward: Callable[..., jax.Array]
    prefill: Callable[..., tuple]
    text_prefix: str
    outside_text: str
    forward_bytes: Callable[..., int]
    image_spans: bool = False
    parts: Mapping[str, VisionPart] = field(default_factory=dict, hash=False, compare=False)  # one of a kind


@dataclass(frozen=True)
class ImageSide:
    """A training run's image side: the family, its image-side config, and each batch row's pixel arrays
    [max_images, *pixel_shape] (static shapes; the tower runs inside the step, frozen unless the method trains it)."""

    family: VisionFamily
    config: Any
    max_images: int
    pixel_shape: tuple[int, ...]


@dataclass(frozen=True)
class ImageProcessor:
    """A model's processor, bound to its directory's settings and tokenizer: `__call__(images)` -> (float32 pixel
    arrays [N, *shape], the text each image's `marker` becomes)."""

    family: VisionFamily
    config: Any
    processing: Any
    tokenizer: Any

    @property
    def marker(self) -> str:
        return self.family.marker(self.tokenizer, self.config)

    @property
    def image_token(self) -> int:
        return self.family.image_token(self.config)

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return self.family.pixel_shape(self.processing)

    def __call__(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, list[str]]:
        if not images:
            return np.zeros((0, *self.pixel_shape), np.float32), []
        pixels, arrays = self.family.pixels(images, self.processing)
        return pixels, [self.family.expansion(self.tokenizer, self.config, n) for n in arrays]
