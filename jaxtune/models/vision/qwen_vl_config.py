"""Qwen2.5-VL's vision settings as frozen dataclasses: the tower's architecture (`QwenVisionConfig`, from config.json's
`vision_config`), the image side of the whole model (`QwenVLConfig`: the tower and its tokens in the text) and its
image preprocessing (`QwenImageOptions`, from preprocessor_config.json), each read from the checkpoint's dict; a value
jaxtune does not compute (another activation, resample filter, a skipped step) is refused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxtune.errors import JaxtuneError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the CLIP normalisation Qwen2-VL's processor uses
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
QWEN_VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")  # a config.json's, its vision_config's
VISION_ACTIVATIONS = ("silu",)  # the blocks' gated MLP (the merger's is GELU, erf form, always)
HF_VISION_NAMES = {"fullatt_block_indexes": "fullatt_blocks", "in_chans": "in_channels"}  # config.json's -> ours


class QwenTowerShape:
    """What the Qwen-VL towers' configs (Qwen2.5-VL's, Qwen3-VL's) derive alike from their fields."""

    hidden_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int

    def check_heads(self) -> None:
        """A one-line error unless the head size divides into the 2D rotary's four quarters."""
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise JaxtuneError(f"vision hidden_size {self.hidden_size} over {self.num_heads} heads: the head size "
                               "must be a multiple of 4 (its rotary halves split between rows and columns)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch of `pixel_values`: C * temporal_patch_size * patch_size²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token: spatial_merge_size²."""
        return self.spatial_merge_size ** 2


@dataclass(frozen=True, kw_only=True)
class QwenVisionConfig(QwenTowerShape):
    """Qwen2.5-VL's vision transformer. window_size counts pixels: a window is window_size // merge // patch merged
    tokens on a side. fullatt_blocks: the blocks that attend over the whole image instead of within windows."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_blocks: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # transformers' fixed epsilon of the blocks' and the merger's RMSNorms

    def __post_init__(self):
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise JaxtuneError(f"vision hidden_act {self.hidden_act!r}: jaxtune knows {VISION_ACTIVATIONS}")
        self.check_heads()
        if self.window_size % (self.spatial_merge_size * self.patch_size):
            raise JaxtuneError(f"vision window_size {self.window_size} is not a multiple of spatial_merge_size * "
                               f"patch_size = {self.spatial_merge_size * self.patch_size}")


    @property
    def window_tokens(self) -> int:
        """Merged tokens on a window's side."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True, kw_only=True)
class QwenVLConfig:
    """Qwen2.5-VL's image path (`Qwen2_5_VLConfig` beside its text config): the tower's merged embeddings replace the
    text's `image_token_id` placeholders (a run an image, which the chat template brackets by vision_start_token_id
    and vision_end_token_id) and take M-RoPE positions (`qwen2_5_vl.image_placement`); no bidirectional spans."""

    tower: QwenVisionConfig
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653


@dataclass(frozen=True, kw_only=True)
class QwenImageOptions:
    """Qwen2-VL's image processor (Qwen2.5-VL's too): images resized so each side is a multiple of
    patch_size * merge_size and the area lies in [min_pixels, max_pixels] (`smart_resize`), with Pillow's bicubic
    filter, then scaled to [0, 1] and normalised by mean and std."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    rescale_factor: float = 1 / 255
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD

    @property
    def factor(self) -> int:
        """What both sides of a resized image are a multiple of: patch_size * merge_size."""
        return self.patch_size * self.merge_size


def vision_config_from_hf(hf: dict[str, Any]) -> QwenVisionConfig:
    """The `vision_config` of a Qwen2.5-VL config.json (or the whole config.json, which holds it): our fields by
    their names there (`HF_VISION_NAMES` where they differ), rope_theta from rope_parameters, the rest (video's
    tokens_per_second) not the tower's."""
    if hf.get("model_type", "qwen2_5_vl") not in QWEN_VL_MODEL_TYPES:
        raise JaxtuneError(f"model_type {hf['model_type']!r}: jaxtune reads Qwen2.5-VL's vision tower "
                           f"({QWEN_VL_MODEL_TYPES})")
    hf = hf.get("vision_config", hf)
    fields = {f.name for f in dataclasses.fields(QwenVisionConfig)}
    values = {HF_VISION_NAMES.get(k, k): v for k, v in hf.items() if HF_VISION_NAMES.get(k, k) in fields}
    values["fullatt_blocks"] = tuple(values.get("fullatt_blocks", QwenVisionConfig.fullatt_blocks))
    if "rope_theta" in (hf.get("rope_parameters") or {}):
        values["rope_theta"] = float(hf["rope_parameters"]["rope_theta"])
    missing = [f for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
               if f not in values]
    if missing:
        raise JaxtuneError(f"Qwen2.5-VL vision_config: no {missing}")
    return QwenVisionConfig(**values)


def vision_language_config_from_hf(hf: dict[str, Any], text_hidden_size: int) -> QwenVLConfig:
    """The image side of a Qwen2.5-VL config.json; the tower's output must be the text's `text_hidden_size` wide."""
    tower = vision_config_from_hf(hf)
    if tower.out_hidden_size != text_hidden_size:
        raise JaxtuneError(f"Qwen2.5-VL vision_config out_hidden_size {tower.out_hidden_size}: the text model is "
                           f"{text_hidden_size} wide")
    default = QwenVLConfig(tower=tower)
    return QwenVLConfig(tower=tower, **{k: int(hf.get(k, getattr(default, k))) for k in (
        "image_token_id", "vision_start_token_id", "vision_end_token_id")})


def image_options_from_hf(hf: dict[str, Any]) -> QwenImageOptions:
    """A Qwen2-VL preprocessor_config.json: `size` {shortest_edge, longest_edge} bounds the area, the older
    top-level min_pixels and max_pixels over it (as transformers reads them); patch, merge, scale and normalisation
    values as given."""
    if hf.get("resample", 3) != 3:
        raise JaxtuneError(f"preprocessor_config.json: resample {hf['resample']} (jaxtune resizes with Pillow's "
                           "bicubic filter, 3, as Qwen2-VL's processor)")
    steps = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
    if any(hf.get(step, True) is False for step in steps):
        raise JaxtuneError(f"preprocessor_config.json: jaxtune's Qwen2-VL processor always does {steps}")
    size, default = hf.get("size") or {}, QwenImageOptions()
    return QwenImageOptions(
        patch_size=hf.get("patch_size", default.patch_size),
        temporal_patch_size=hf.get("temporal_patch_size", default.temporal_patch_size),
        merge_size=hf.get("merge_size", default.merge_size),
        min_pixels=hf.get("min_pixels") or size.get("shortest_edge", default.min_pixels),
        max_pixels=hf.get("max_pixels") or size.get("longest_edge", default.max_pixels),
        rescale_factor=hf.get("rescale_factor", default.rescale_factor),
        mean=tuple(hf.get("image_mean", default.mean)), std=tuple(hf.get("image_std", default.std)))
