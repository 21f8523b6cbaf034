"""The vision families jaxtune trains and runs (`family.VisionFamily`: Gemma 3, Qwen2.5-VL, Qwen3-VL, Qwen3.5,
Llama 4, Gemma 4), by the architecture in `config.json`: a new one is its unit and one entry here.
`vision_family(directory)` is None for a text-only model; `required_vision_family` says which families there are when
a directory has none of them."""

from __future__ import annotations

from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.models.hf_config import model_dir
from jaxtune.models.vision.family import ImageProcessor, ImageSide, VisionFamily
from jaxtune.models.vision.gemma3 import GEMMA3
from jaxtune.models.vision.gemma4 import GEMMA4
from jaxtune.models.vision.llama4 import LLAMA4
from jaxtune.models.vision.qwen2_5_vl import QWEN2_5_VL
from jaxtune.models.vision.qwen3_vl import QWEN3_5_VL, QWEN3_VL

FAMILIES: tuple[VisionFamily, ...] = (GEMMA3, QWEN2_5_VL, QWEN3_VL, QWEN3_5_VL, LLAMA4, GEMMA4)


def vision_family(directory: str | Path) -> VisionFamily | None:
    """The vision family of a Hugging Face model directory (None: no image side jaxtune reads, or not a directory)."""
    path = Path(directory) / "config.json"
    if not path.is_file():  # a GGUF file, a Hub id: text only
        return None
    archs = set(read_json(path).get("architectures") or [])
    return next((f for f in FAMILIES if archs & set(f.architectures)), None)


def required_vision_family(model: str | Path) -> VisionFamily:
    """The vision family of the Hugging Face directory `model`; a one-line error naming the supported ones if none."""
    family = vision_family(model_dir(model))
    if family is None:
        archs = read_json(model_dir(model) / "config.json").get("architectures") or []
        raise JaxtuneError(f"{model}: no vision tower jaxtune computes (architectures {', '.join(archs) or 'none'}; "
                           f"supported: {', '.join(a for f in FAMILIES for a in f.architectures)})")
    return family


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
