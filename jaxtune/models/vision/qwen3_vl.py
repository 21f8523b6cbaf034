"""Qwen3-VL as a vision family (`QWEN3_VL`, `family.py`), sharing Qwen2.5-VL's unit where the two are the same: the
image processor (Qwen2-VL's; Qwen3-VL's preprocessor_config.json sets 16-pixel patches, mean and std 0.5), the
padded pixel arrays and their static patch budget, the placeholder text, M-RoPE's positions (`placed_images`; the
text model reads them interleaved, `ModelConfig.mrope_interleaved`), the whole-model forward and prefill. What
differs: the tower (`qwen3_vl_vision`) and DeepStack, its features of `deepstack_visual_indexes` blocks placed like
the merged tokens and added to the text's hidden states after its first layers (`multimodal.DeepStack`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.models.attention import forward_block_bytes
from jaxtune.models.hf_config import load_config, model_dir
from jaxtune.models.multimodal import DeepStack, PlacedEmbeddings
from jaxtune.models.params import ParamSpec
from jaxtune.models.vision.family import VisionFamily
from jaxtune.models.vision.qwen2_5_vl import (
    QWEN2_5_VL,
    padded_images,
    placed_images,
    vision_language_forward,
    vision_language_prefill,
)
from jaxtune.models.vision.qwen3_vl_vision import (
    Qwen3VisionConfig,
    abstract_qwen3_vl_params,
    qwen3_vl_tower,
    tower_names,
)
from jaxtune.models.vision.qwen_vl_weights import conv_shapes, read_tower, tower_tensor_entries

QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_vision")  # a config.json's, its vision_config's
QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_vision", "qwen3_5_moe", "qwen3_5_moe_vision")  # the MoE's tower Qwen3.5's


@dataclass(frozen=True, kw_only=True)
class Qwen3VLConfig:
    """Qwen3-VL's image path (Qwen3.5's too): the tower's merged embeddings replace the text's `image_token_id`
    placeholders (a run an image, bracketed by vision_start_token_id and vision_end_token_id) and take M-RoPE
    positions; its DeepStack features, if any, are added to the same positions after the text's first layers."""

    tower: Qwen3VisionConfig
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653


def vision_config_from_hf(hf: dict[str, Any]) -> Qwen3VisionConfig:
    """The `vision_config` of a Qwen3-VL or Qwen3.5 config.json (or the whole config.json): our fields by their names
    there (Qwen3.5's tower has no DeepStack), rope_theta from rope_parameters; the rest not the tower's."""
    kind = hf.get("model_type", "qwen3_vl")
    if kind not in QWEN3_VL_MODEL_TYPES + QWEN3_5_MODEL_TYPES:
        raise JaxtuneError(f"model_type {kind!r}: jaxtune reads Qwen3-VL's and Qwen3.5's vision towers here")
    hf = hf.get("vision_config", hf)
    fields = {f.name for f in dataclasses.fields(Qwen3VisionConfig)}
    values = {k: v for k, v in hf.items() if k in fields}
    values["deepstack_visual_indexes"] = tuple(values.get("deepstack_visual_indexes", (
        () if kind in QWEN3_5_MODEL_TYPES else Qwen3VisionConfig.deepstack_visual_indexes)))
    if "rope_theta" in (hf.get("rope_parameters") or {}):
        values["rope_theta"] = float(hf["rope_parameters"]["rope_theta"])
    missing = [f for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
               if f not in values]
    if missing:
        raise JaxtuneError(f"Qwen3-VL vision_config: no {missing}")
    return Qwen3VisionConfig(**values)


def vision_language_config_from_hf(hf: dict[str, Any], text_hidden_size: int) -> Qwen3VLConfig:
    """The image side of a Qwen3-VL config.json; the tower's output must be the text's `text_hidden_size` wide."""
    tower = vision_config_from_hf(hf)
    if tower.out_hidden_size != text_hidden_size:
        raise JaxtuneError(f"Qwen3-VL vision_config out_hidden_size {tower.out_hidden_size}: the text model is "
                           f"{text_hidden_size} wide")
    default = Qwen3VLConfig(tower=tower)
    return Qwen3VLConfig(tower=tower, **{k: int(hf.get(k, getattr(default, k))) for k in (
        "image_token_id", "vision_start_token_id", "vision_end_token_id")})


def image_inputs(vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array, positions_BxT: jax.Array | None,
                 cfg: ModelConfig, vision: Qwen3VLConfig, dtype) -> tuple[jax.Array, dict]:
    """(tokens [B, T], the decoder's keywords: `positions_BxT` M-RoPE's [3, B, T], `placed_embeddings`, `deepstack`)
    of rows whose `image_token_id` runs take the images ([N, *pixel_shape] or each row's [B, M, *pixel_shape], as
    `qwen2_5_vl.image_inputs`); the merged tokens and the K DeepStack features placed together."""
    del cfg, dtype  # the tower computes in its weights' dtype, as transformers'
    patches_IxNxP, grid_Ix3 = padded_images(pixel_values)
    merged_IxKxD, deepstack_SxIxKxD = qwen3_vl_tower(vision_params, patches_IxNxP, grid_Ix3, vision.tower)
    S, D = deepstack_SxIxKxD.shape[0], merged_IxKxD.shape[-1]
    together_IxKxX = jnp.concatenate([merged_IxKxD, *deepstack_SxIxKxD], axis=-1)  # [I, K, (1 + S) D]
    positions, placed = placed_images(together_IxKxX, grid_Ix3, tokens_BxT, pixel_values.ndim == 4, positions_BxT,
                                      vision.tower.spatial_merge_size, vision.image_token_id)
    inputs = dict(positions_BxT=positions, placed_embeddings=PlacedEmbeddings(placed.vectors_NxD[..., :D],
                                                                              placed.at_BxT))
    if S:  # Qwen3.5's tower has none: the decoder without the hook
        B, T = tokens_BxT.shape
        inputs["deepstack"] = DeepStack(jnp.moveaxis(placed.vectors_NxD[..., D:].reshape(B, T, S, D), 2, 0),
                                        placed.at_BxT)
    return tokens_BxT, inputs


def read_config(directory) -> Qwen3VLConfig:
    path = model_dir(directory)
    return vision_language_config_from_hf(read_json(path / "config.json"), load_config(path).hidden_size)


def tower_bytes(vision: Qwen3VLConfig, shape: tuple[int, ...], arrays: int, itemsize: int) -> int:
    """Bytes the image side holds at once for `arrays` padded images, values of `itemsize` bytes: their pixels, one
    block's [N, .] values (the residual, its norm, q, k, v, the attention's output: 6 x D; the MLP's two of F), the
    merged tokens and the DeepStack features, and the attention kernel's float32 working set."""
    t, N = vision.tower, shape[0] - 1
    values = (shape[0] * shape[1] + N * (6 * t.hidden_size + 2 * t.intermediate_size)
              + (1 + len(t.deepstack_visual_indexes)) * N // t.merge_unit * t.out_hidden_size)
    return arrays * (values * itemsize + forward_block_bytes(N, t.num_heads, t.hidden_size))


QWEN3_VL = VisionFamily(
    name="qwen3_vl", architectures=("Qwen3VLForConditionalGeneration",), read_config=read_config,
    param_specs=lambda vision: jax.tree.map(lambda s: ParamSpec(s.shape, (None,) * len(s.shape)),
                                            abstract_qwen3_vl_params(vision.tower)),
    read_params=lambda directory, vision, dtype: jax.tree.map(jnp.asarray, read_tower(
        model_dir(directory), abstract_qwen3_vl_params(vision.tower), tower_names(vision.tower), dtype)),
    tensor_entries=lambda params, vision, dtype: tower_tensor_entries(params, tower_names(vision.tower), conv_shapes(
        vision.tower.hidden_size, vision.tower.in_channels, vision.tower.temporal_patch_size,
        vision.tower.patch_size), dtype),
    read_processing=QWEN2_5_VL.read_processing, pixels=QWEN2_5_VL.pixels, pixel_shape=QWEN2_5_VL.pixel_shape,
    marker=QWEN2_5_VL.marker, expansion=QWEN2_5_VL.expansion, image_token=lambda vision: vision.image_token_id,
    image_inputs=image_inputs, forward=functools.partial(vision_language_forward, inputs=image_inputs),
    prefill=functools.partial(vision_language_prefill, inputs=image_inputs), text_prefix="model.language_model.",
    outside_text=r".*visual.*", forward_bytes=tower_bytes)
# Qwen3.5's image side (Qwen3.5-MoE's the same) is Qwen3-VL's without DeepStack; its text model Qwen3.5's (Gated
# DeltaNet layers; the MoE's experts), read by the text families
QWEN3_5_VL = dataclasses.replace(QWEN3_VL, name="qwen3_5", architectures=(
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"))
