"""The vision-language families jaxtune runs whole, by config.json's architecture (`vision_language_family`): each
one's image-side config and tower read from the checkpoint, and its `vision_language_forward` and
`vision_language_prefill` (Gemma 3's take pixel values [N, C, H, W]; Qwen2.5-VL's its `image_inputs`)."""

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
from jaxtune.models.vision.qwen_vl_config import vision_language_config_from_hf
from jaxtune.models.vision.qwen_vl_weights import read_vision_params as read_qwen_tower


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


FAMILIES = {
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
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        raise JaxtuneError(f"{path}: no vision tower jaxtune computes (architectures {', '.join(archs) or 'none'}; "
                           f"supported: {', '.join(FAMILIES)})")
    return FAMILIES[arch]
