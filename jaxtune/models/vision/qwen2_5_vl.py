"""Qwen2.5-VL as a vision family (`QWEN2_5_VL`, `family.py`), everything inside one jit with static shapes: an image is
one pixel array [1 + max_patches, patch_dim], row 0 its grid (t, h, w) in patches, then its patches in the
processor's order, zeros past them (the budget `max_patches` from preprocessor_config.json's max_pixels, the most
patches `smart_resize` gives an image); `image_inputs` runs the tower on the padded images
(`qwen_vl_vision.padded_vision_forward`) and derives M-RoPE's [3, B, T] positions from the traced tokens, grids and
each example's plain positions (a packed row's examples restart at 0), as transformers' `get_rope_index`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.models.attention import forward_block_bytes
from jaxtune.models.hf_config import load_config, model_dir
from jaxtune.models.kv_cache import KVCache, prefill
from jaxtune.models.llama import forward
from jaxtune.models.multimodal import PlacedEmbeddings
from jaxtune.models.params import ParamSpec
from jaxtune.models.vision.family import VisionFamily, VisionPart
from jaxtune.models.vision.qwen_vl_config import (
    QwenImageOptions,
    QwenVLConfig,
    image_options_from_hf,
    vision_language_config_from_hf,
)
from jaxtune.models.vision.qwen_vl_processor import image_patches
from jaxtune.models.vision.qwen_vl_vision import abstract_vision_params, padded_vision_forward
from jaxtune.models.vision.qwen_vl_weights import QWEN2_5_VL_NAMES, read_vision_params, vision_tensor_entries


def max_patches(options: QwenImageOptions) -> int:
    """The patches an image may take: as many whole merge blocks as max_pixels holds."""
    return options.max_pixels // options.factor**2 * options.merge_size**2


def pixel_shape(options: QwenImageOptions) -> tuple[int, int]:
    """One image's pixel array: [1 + max_patches, C * temporal_patch_size * patch²]."""
    return 1 + max_patches(options), 3 * options.temporal_patch_size * options.patch_size**2


def image_arrays(images, options: QwenImageOptions) -> tuple[np.ndarray, list[int]]:
    """(float32 [N, *pixel_shape]: each image's grid row, then its patches as `Qwen2VLImageProcessor` gives them
    (`image_patches`), then zeros; each image's `<|image_pad|>` tokens, t h w / merge²)."""
    out: np.ndarray = np.zeros((len(images), *pixel_shape(options)), np.float32)
    if not images:
        return out, []
    values, grids = image_patches(images, options)
    sizes = grids.prod(-1)
    for i, (rows, grid) in enumerate(zip(np.split(values, np.cumsum(sizes)[:-1]), grids)):
        out[i, 0, :3] = grid
        out[i, 1:1 + len(rows)] = rows
    return out, (sizes // options.merge_size**2).tolist()


def image_placement(is_image_RxL: jax.Array, grid_RxMx3: jax.Array, positions_RxL: jax.Array, merge: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the image of each token [R, L], its index there [R, L], M-RoPE's positions [3, R, L]) of rows whose image
    tokens are, in order, runs of the row's images of grids (t, h, w) [R, M, 3] in patches (t h w / merge² tokens
    each; t = 0: no image). Text counts on in all three streams from each example's start (plain position 0); an
    image's tokens take its start plus (frame, row, column) in its merged grid, the text after it resumes at its
    start plus the longer merged side."""
    height_RxM, width_RxM = grid_RxMx3[..., 1] // merge, grid_RxMx3[..., 2] // merge
    counts_RxM = grid_RxMx3[..., 0] * height_RxM * width_RxM
    ends_RxM = jnp.cumsum(counts_RxM, axis=1)
    before_RxL = jnp.cumsum(is_image_RxL, axis=1) - is_image_RxL  # image tokens before each token
    image_RxL = jnp.minimum(jnp.sum(before_RxL[..., None] >= ends_RxM[:, None], -1), counts_RxM.shape[1] - 1)
    pick = lambda a: jnp.take_along_axis(a, image_RxL, axis=1)
    k_RxL = before_RxL - pick(ends_RxM - counts_RxM)
    width, height = jnp.maximum(pick(width_RxM), 1), pick(height_RxM)
    last = is_image_RxL & (k_RxL == pick(counts_RxM) - 1)  # the text after an image resumes at its longer side
    advance = jnp.where(is_image_RxL, jnp.where(last, jnp.maximum(width, height), 0), 1)
    before = jnp.cumsum(advance, axis=1) - advance
    start = before - jax.lax.cummax(jnp.where(positions_RxL == 0, before, 0), axis=1)  # from each example's start
    frame_size = width * jnp.maximum(height, 1)
    offsets = jnp.stack([k_RxL // frame_size, k_RxL % frame_size // width, k_RxL % width])
    return image_RxL, k_RxL, start[None] + jnp.where(is_image_RxL[None], offsets, 0)


def padded_images(pixel_values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(patches [I, max_patches, patch_dim], grids (t, h, w) int32 [I, 3]) of pixel arrays [N, *pixel_shape] or
    [B, M, *pixel_shape] (`image_arrays`' rows: the grid, then the patches)."""
    images = pixel_values.reshape(-1, *pixel_values.shape[-2:])
    return images[:, 1:], jnp.round(images[:, 0, :3]).astype(jnp.int32)


def placed_images(vectors_IxKxX: jax.Array, grid_Ix3: jax.Array, tokens_BxT: jax.Array, per_row: bool,
                  positions_BxT: jax.Array | None, merge: int, image_token_id: int
                  ) -> tuple[jax.Array, PlacedEmbeddings]:
    """(M-RoPE's positions [3, B, T], each `image_token_id` token's vector as `PlacedEmbeddings` [B, T, X]) of rows
    whose image token runs take the images' merged vectors [I, K, X] in row-major order over the batch, or (per_row)
    each row its own M images (I = B M; padding images, grid 0, never placed). positions_BxT: each example's plain
    positions (None: one example a row from 0)."""
    B, T = tokens_BxT.shape
    if positions_BxT is None:
        positions_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
    R = B if per_row else 1
    grid = grid_Ix3.reshape(R, -1, 3)
    at_BxT = tokens_BxT == image_token_id
    image, k, positions = image_placement(at_BxT.reshape(R, -1), grid, positions_BxT.reshape(R, -1), merge)
    index = (jnp.arange(R)[:, None] * grid.shape[1] + image).reshape(B, T)
    vectors_BxTxX = vectors_IxKxX[index, jnp.clip(k, 0, vectors_IxKxX.shape[1] - 1).reshape(B, T)]
    # each token its own vector: placed in order over the row's marked tokens, a token's is its own
    order_BxT = jnp.argsort(~at_BxT, axis=1, stable=True)
    placed = PlacedEmbeddings(jnp.take_along_axis(vectors_BxTxX, order_BxT[..., None], axis=1), at_BxT)
    return positions.reshape(3, B, T), placed


def image_inputs(vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array, positions_BxT: jax.Array | None,
                 cfg: ModelConfig, vision: QwenVLConfig, dtype) -> tuple[jax.Array, dict]:
    """(tokens [B, T], the decoder's keywords: `positions_BxT` M-RoPE's [3, B, T], `placed_embeddings`) of rows whose
    `image_token_id` runs take the images: [N, *pixel_shape] in row-major order over the batch, or each row's own
    [B, M, *pixel_shape] (`placed_images`). positions_BxT: each example's plain positions (None: from 0)."""
    del cfg, dtype  # the tower computes in its weights' dtype, as transformers'
    patches_IxNxP, grid_Ix3 = padded_images(pixel_values)
    merged_IxKxD = padded_vision_forward(vision_params, patches_IxNxP, grid_Ix3, vision.tower)
    positions, placed = placed_images(merged_IxKxD, grid_Ix3, tokens_BxT, pixel_values.ndim == 4, positions_BxT,
                                      vision.tower.spatial_merge_size, vision.image_token_id)
    return tokens_BxT, dict(positions_BxT=positions, placed_embeddings=placed)


def vision_language_forward(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array | None,
                            cfg: ModelConfig, vision, *, options: ForwardOptions = ForwardOptions(),
                            inputs: Callable[..., tuple] = image_inputs, **kwargs) -> jax.Array:
    """Logits [B, T, V] of a text with images (pixel arrays through `inputs`, the family's `image_inputs`; None: the
    text alone), keyword arguments as for `llama.forward`."""
    if pixel_values is None:
        return forward(params, tokens_BxT, cfg, options=options, **kwargs)
    tokens_BxT, images = inputs(vision_params, tokens_BxT, pixel_values, kwargs.pop("positions_BxT", None), cfg,
                                vision, None)
    return forward(params, tokens_BxT, cfg, options=options, **kwargs, **images)


def vision_language_prefill(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array,
                            cfg: ModelConfig, vision, *, options: ForwardOptions = ForwardOptions(),
                            inputs: Callable[..., tuple] = image_inputs, **kwargs) -> tuple[jax.Array, KVCache]:
    """`kv_cache.prefill` of unpadded prompts with images (through `inputs`, the family's `image_inputs`): logits
    [B, V] of the next token and the cache, decoding on from each row's largest M-RoPE position + 1 (transformers'
    rope deltas)."""
    tokens_BxT, images = inputs(vision_params, tokens_BxT, pixel_values, kwargs.pop("positions_BxT", None), cfg,
                                vision, None)
    logits_BxV, cache = prefill(params, tokens_BxT, cfg, options=options, **kwargs, **images)
    return logits_BxV, cache._replace(next_position_B=images["positions_BxT"].max(axis=(0, 2)) + 1)


def read_config(directory) -> QwenVLConfig:
    path = model_dir(directory)
    return vision_language_config_from_hf(read_json(path / "config.json"), load_config(path).hidden_size)


def read_processing(directory) -> QwenImageOptions:
    path = model_dir(directory) / "preprocessor_config.json"
    return image_options_from_hf(read_json(path) if path.is_file() else {})


def param_specs(vision: QwenVLConfig) -> dict:
    """The tower's tree (`abstract_vision_params`) as `ParamSpec`s, replicated."""
    return jax.tree.map(lambda s: ParamSpec(s.shape, (None,) * len(s.shape)), abstract_vision_params(vision.tower))


def _token(tokenizer, token_id: int) -> str:
    text = tokenizer.backend.id_to_token(token_id)
    if text is None:
        raise JaxtuneError(f"the tokenizer has no image token (id {token_id}) of the model's config.json")
    return text


def tower_bytes(vision: QwenVLConfig, shape: tuple[int, ...], arrays: int, itemsize: int, saved: bool = False
                ) -> int:
    """Bytes the image side holds at once for `arrays` padded images, values of `itemsize` bytes: their pixels, one
    block's [N, .] values (the residual, its norm, q, k, v, the attention's output: 6 x D; the gated MLP's three of
    F; `saved`: beside them every block's input [N, D], what a trained tower's rematerialised backward keeps), the
    merged tokens, and the attention kernel's float32 working set (`attention.forward_block_bytes`)."""
    t, N = vision.tower, shape[0] - 1
    inputs = t.depth * N * t.hidden_size if saved else 0
    values = (shape[0] * shape[1] + inputs + N * (6 * t.hidden_size + 3 * t.intermediate_size)
              + N // t.merge_unit * t.out_hidden_size)
    return arrays * (values * itemsize + forward_block_bytes(N, t.num_heads, t.hidden_size))


QWEN2_5_VL = VisionFamily(
    name="qwen2_5_vl", architectures=("Qwen2_5_VLForConditionalGeneration",), read_config=read_config,
    param_specs=param_specs,
    read_params=lambda directory, vision, dtype: jax.tree.map(jnp.asarray, read_vision_params(
        model_dir(directory), vision.tower, dtype)),
    tensor_entries=lambda params, vision, dtype: vision_tensor_entries(params, vision.tower, dtype),
    read_processing=read_processing, pixels=image_arrays, pixel_shape=pixel_shape,
    marker=lambda tokenizer, vision: _token(tokenizer, vision.image_token_id),
    expansion=lambda tokenizer, vision, count: _token(tokenizer, vision.image_token_id) * count,
    image_token=lambda vision: vision.image_token_id, image_inputs=image_inputs,
    forward=vision_language_forward, prefill=vision_language_prefill, text_prefix="model.language_model.",
    outside_text=r".*visual.*", forward_bytes=tower_bytes,
    parts={"visual": VisionPart(keys=("patch_embed", "blocks"), linears={  # less its merger, as LLaMA-Factory's
        key: f"model.visual.{hf}" for key, hf in QWEN2_5_VL_NAMES.items()
        if key[0] == "blocks" and "norm" not in key[1]}),
        "visual.merger": VisionPart(keys=("merger",), saved="visual.merger")})
