"""Qwen2.5-VL's images in its text (transformers' `Qwen2_5_VLForConditionalGeneration`): `image_inputs` computes on the
host what a batch's images need beside their pixels (the tower's window layout, M-RoPE's three position streams and
each row's rope delta); `vision_language_forward` (and `vision_language_prefill`, for decoding) runs the tower
(`qwen_vl_vision.vision_forward`) and the shared decoder with its embeddings placed over the `<|image_pad|>` tokens'
(`multimodal.PlacedEmbeddings`) and every layer's RoPE taking the [3, B, T] positions (`rope.mrope_angles`). Decoding
goes on at each row's text position plus its delta: three equal streams, plain RoPE (`kv_cache.decode_step`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.kv_cache import KVCache, prefill
from jaxtune.models.llama import forward
from jaxtune.models.multimodal import PlacedEmbeddings
from jaxtune.models.vision.mrope import rope_index
from jaxtune.models.vision.qwen_vl_config import QwenVLConfig
from jaxtune.models.vision.qwen_vl_layout import VisionLayout, vision_layout
from jaxtune.models.vision.qwen_vl_vision import vision_forward


class QwenImages(NamedTuple):
    """A batch's images as the jitted forward takes them, a pytree: pixel_values_NxP [N, C * T * P * P] (the
    processor's, `qwen_vl_processor.image_patches`), their `VisionLayout`, positions_3xBxT int32 (M-RoPE's time, row
    and column streams of every token) and deltas_B int32 (each row's next position minus its token count)."""

    pixel_values_NxP: jax.Array
    layout: VisionLayout
    positions_3xBxT: jax.Array
    deltas_B: jax.Array


def image_inputs(tokens_BxT: np.ndarray, pixel_values_NxP: np.ndarray, image_grid_thw: np.ndarray,
                 vision: QwenVLConfig, attention_mask_BxT: np.ndarray | None = None) -> QwenImages:
    """`QwenImages` of token rows [B, T] (on the host) holding, in order, a run of t h w / merge² `image_token_id`
    placeholders for each image of `image_grid_thw` [images, 3]; padding (attention_mask 0) gets position 0."""
    tokens_BxT = np.asarray(tokens_BxT)
    merge = vision.tower.spatial_merge_size
    found, wanted = int(np.sum(tokens_BxT == vision.image_token_id)), int(np.prod(image_grid_thw, -1).sum())
    if found * merge**2 != wanted:
        raise JaxtuneError(f"{found} image placeholder tokens (id {vision.image_token_id}) for images of "
                           f"{wanted // merge**2} merged patches (image_grid_thw {np.asarray(image_grid_thw).tolist()}"
                           ")")
    positions, deltas = rope_index(tokens_BxT, image_grid_thw, image_token_id=vision.image_token_id,
                                   spatial_merge_size=merge, attention_mask_BxT=attention_mask_BxT)
    return QwenImages(jnp.asarray(pixel_values_NxP), vision_layout(image_grid_thw, vision.tower),
                      jnp.asarray(positions, jnp.int32), jnp.asarray(deltas[:, 0], jnp.int32))


def decoder_inputs(vision_params: dict, tokens_BxT: jax.Array, images: QwenImages, vision: QwenVLConfig) -> dict:
    """The decoder's image keywords: `positions_BxT` (the [3, B, T] streams) and `placed_embeddings` (the tower's
    output [M, D] over the placeholders, in order)."""
    embeddings_MxD = vision_forward(vision_params, images.pixel_values_NxP, images.layout, vision.tower)
    return dict(positions_BxT=images.positions_3xBxT,
                placed_embeddings=PlacedEmbeddings(embeddings_MxD, tokens_BxT == vision.image_token_id))


def vision_language_forward(params: dict, vision_params: dict, tokens_BxT: jax.Array, images: QwenImages | None,
                            cfg: ModelConfig, vision: QwenVLConfig, *, options: ForwardOptions = ForwardOptions(),
                            **kwargs) -> jax.Array:
    """Logits [B, T, V] (as `llama.forward`) of a text with images (`image_inputs`); None: the text alone. Keyword
    arguments as for `llama.forward`; jit with `static_argnames=("cfg", "vision", ...)`."""
    if images is None:
        return forward(params, tokens_BxT, cfg, options=options, **kwargs)
    return forward(params, tokens_BxT, cfg, options=options, **kwargs,
                   **decoder_inputs(vision_params, tokens_BxT, images, vision))


def vision_language_prefill(params: dict, vision_params: dict, tokens_BxT: jax.Array, images: QwenImages,
                            cfg: ModelConfig, vision: QwenVLConfig, *, options: ForwardOptions = ForwardOptions(),
                            **kwargs) -> tuple[jax.Array, KVCache]:
    """`kv_cache.prefill` of prompts with images (`image_inputs`, of the same attention mask): logits [B, V] of the
    next token and the cache, whose next positions are moved on by the rows' rope deltas (transformers'
    `rope_deltas`) so that `kv_cache.decode_step` continues as transformers' `generate`."""
    logits_BxV, cache = prefill(params, tokens_BxT, cfg, options=options, **kwargs,
                                **decoder_inputs(vision_params, tokens_BxT, images, vision))
    return logits_BxV, cache._replace(next_position_B=cache.next_position_B + images.deltas_B)
