"""The vision families jaxtune trains and runs (`family.VisionFamily`), by the architecture in `config.json`: a new
one is its unit and one entry here. `vision_family(directory)` is None for a text-only model."""

from __future__ import annotations

from pathlib import Path

from jaxtune.io.json import read_json
from jaxtune.models.hf_config import model_dir
from jaxtune.models.vision.family import ImageProcessor, ImageSide, VisionFamily
from jaxtune.models.vision.gemma3 import GEMMA3

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
