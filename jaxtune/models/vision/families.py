"""The vision families jaxtune trains and runs (`family.VisionFamily`), by the architecture in `config.json`: a new
one is its unit and one entry here. `vision_family(directory)` is None for a text-only model. Until Qwen2.5-VL is a
unit too, `vision_language_family` names each whole-model family's config and tower readers, forward and prefill
(Gemma 3's take pixel values [N, C, H, W]; Qwen2.5-VL's its `image_inputs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.models.hf_config import load_config, model_dir
from jaxtune.models.vision import gemma3, hf, qwen_vl
from jaxtune.models.vision.family import ImageProcessor, ImageSide, VisionFamily
from jaxtune.models.vision.gemma3 import GEMMA3
from jaxtune.models.vision.qwen_vl_config import vision_language_config_from_hf
from jaxtune.models.vision.qwen_vl_weights import read_vision_params as read_qwen_tower

FAMILIES: tuple[VisionFamily, ...] = (GEMMA3,)


def vision_family(directory: str | Path) -> VisionFamily | None:
    """The vision family of a Hugging Face model directory (None: no image side jaxtune reads, or not a directory)."""
    path = Path(directory) / "config.json"
    if not path.is_file():  # a GGUF file, a Hub id: text only
        return None
    archs = set(read_json(path).get("architectures") or [])
    return next((f for f in FAMILIES if archs & set(f.architectures)), None)


def image_processor(directory: str | Path, tokenizer) -> ImageProcessor | None:
    """The processor of a vision-language directory bound to `tokenizer` (None for a text-only model)."""
    family = vision_family(directory)
    if family is None:
        return None
    path = model_dir(directory)
    return ImageProcessor(family, family.read_config(path), family.read_processing(path), tokenizer)


def image_side(directory: str | Path, max_images: int) -> ImageSide | None:
    """The image side a training run of a vision-language directory holds (None for a text-only model)."""
    family = vision_family(directory)
    if family is None:
        return None
    path = model_dir(directory)
    return ImageSide(family, family.read_config(path), max_images, family.pixel_shape(family.read_processing(path)))


class VisionLanguageFamily(NamedTuple):
    """read_config(directory) -> the image side's config; read_params(directory, that config, dtype) -> its tree;
    forward and prefill: the family's `vision_language_forward` and `vision_language_prefill`."""

    read_config: Callable[[Path], Any]
    read_params: Callable[[Path, Any, Any], dict]
    forward: Callable[..., jax.Array]
    prefill: Callable[..., tuple]


def _qwen_config(directory: Path):
    return vision_language_config_from_hf(read_json(directory / "config.json"), load_config(directory).hidden_size)


def _qwen_params(directory: Path, vision, dtype) -> dict:
    return jax.tree.map(jnp.asarray, read_qwen_tower(directory, vision.tower, dtype))


WHOLE_MODELS = {
    "Gemma3ForConditionalGeneration": VisionLanguageFamily(hf.load_vision_config, hf.read_vision_params,
                                                           gemma3.vision_language_forward,
                                                           gemma3.vision_language_prefill),
    "Qwen2_5_VLForConditionalGeneration": VisionLanguageFamily(_qwen_config, _qwen_params,
                                                               qwen_vl.vision_language_forward,
                                                               qwen_vl.vision_language_prefill),
}


def vision_language_family(model: str | Path) -> VisionLanguageFamily:
    """The family of the Hugging Face directory `model`, by its config.json's architectures."""
    path = model_dir(model) / "config.json"
    archs = read_json(path).get("architectures") or []
    arch = next((a for a in archs if a in WHOLE_MODELS), None)
    if arch is None:
        raise JaxtuneError(f"{path}: no vision tower jaxtune computes (architectures {', '.join(archs) or 'none'}; "
                           f"supported: {', '.join(WHOLE_MODELS)})")
    return WHOLE_MODELS[arch]
