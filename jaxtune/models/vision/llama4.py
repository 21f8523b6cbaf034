"""Llama 4's images in its text (transformers' `Llama4ForConditionalGeneration`) as a vision family (`LLAMA4`,
`family.py`): each tile is one pixel array [3, S, S] (`llama4_processor.image_tiles`: an image's tiles, then its
global tile), a batch row holds a budget of them padded with zeros (static shapes, padding never placed); each tile's
soft tokens (`llama4_vision.tile_soft_tokens`) replace its run of `<|patch|>` placeholders, in order. The text
attends as it does without images, causally and in its chunks: transformers 5.24's Llama 4 gives image tokens no
bidirectional mask. The processor's text: `<|image_start|>`, each tile's patches (tiles of a row split by
`<|tile_x_separator|>`, rows ended by `<|tile_y_separator|>`), `<|image|>`, the global tile's, `<|image_end|>`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.attention import forward_block_bytes
from jaxtune.models.kv_cache import KVCache, prefill
from jaxtune.models.llama import forward
from jaxtune.models.multimodal import PlacedEmbeddings
from jaxtune.models.vision import llama4_vision
from jaxtune.models.vision.family import VisionFamily
from jaxtune.models.vision.llama4_processor import Llama4ImageOptions, image_tiles, read_options
from jaxtune.models.vision.llama4_vision import Llama4VisionConfig, tile_soft_tokens

# Llama4Processor's strings (its `_prompt_split_image` writes them literally)
IMAGE_MARKER, IMAGE_START, IMAGE_END = "<|image|>", "<|image_start|>", "<|image_end|>"
PATCH, TILE_X, TILE_Y = "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"


def image_inputs(vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array, positions_BxT: jax.Array | None,
                 cfg: ModelConfig, vision: Llama4VisionConfig, dtype) -> tuple[jax.Array, dict]:
    """(tokens [B, T], the decoder's keywords: `positions_BxT` as given, `placed_embeddings`) of rows whose
    `<|patch|>` runs (tokens_per_tile each) take the tiles' soft tokens: N tiles [N, C, S, S] in row-major order
    over the batch, or each row's own [B, M, C, S, S] (padding tiles never placed). Tokens known outside jit are
    checked to hold N x tokens_per_tile placeholders."""
    del cfg
    if not isinstance(tokens_BxT, jax.core.Tracer) and pixel_values.ndim == 4:
        found, tiles = int(np.sum(np.asarray(tokens_BxT) == vision.image_token_id)), pixel_values.shape[0]
        if found != tiles * vision.tokens_per_tile:
            raise JaxtuneError(f"{found} image placeholder tokens (id {vision.image_token_id}) for {tiles} tiles of "
                               f"{vision.tokens_per_tile} soft tokens each")
    tiles_NxKxD = tile_soft_tokens(vision_params, pixel_values.reshape(-1, *pixel_values.shape[-3:]), vision, dtype)
    D = tiles_NxKxD.shape[-1]
    vectors = tiles_NxKxD.reshape(-1, D) if pixel_values.ndim == 4 else tiles_NxKxD.reshape(
        pixel_values.shape[0], -1, D)
    placed = PlacedEmbeddings(vectors, tokens_BxT == vision.image_token_id)
    return tokens_BxT, dict(positions_BxT=positions_BxT, placed_embeddings=placed)


def vision_language_forward(params: dict, vision_params: dict, tokens_BxT: jax.Array,
                            pixel_values_NxCxSxS: jax.Array | None, cfg: ModelConfig, vision: Llama4VisionConfig,
                            *, options: ForwardOptions = ForwardOptions(), **kwargs) -> jax.Array:
    """Logits [B, T, V] (as `llama.forward`) of a text with N tiles [N, C, S, S] (`image_inputs`); None or N = 0:
    the text alone."""
    if pixel_values_NxCxSxS is None or pixel_values_NxCxSxS.shape[0] == 0:
        return forward(params, tokens_BxT, cfg, options=options, **kwargs)
    tokens_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values_NxCxSxS,
                                      kwargs.pop("positions_BxT", None), cfg, vision, jnp.dtype(options.compute_dtype))
    return forward(params, tokens_BxT, cfg, options=options, **kwargs, **images)


def vision_language_prefill(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values_NxCxSxS: jax.Array,
                            cfg: ModelConfig, vision: Llama4VisionConfig, *,
                            options: ForwardOptions = ForwardOptions(), **kwargs) -> tuple[jax.Array, KVCache]:
    """`kv_cache.prefill` of prompts with N tiles: logits [B, V] of the next token and the cache, which
    `kv_cache.decode_step` continues."""
    tokens_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values_NxCxSxS,
                                      kwargs.pop("positions_BxT", None), cfg, vision, jnp.dtype(options.compute_dtype))
    return prefill(params, tokens_BxT, cfg, options=options, **kwargs, **images)


def _checked(tokenizer, *texts: str) -> None:
    for text in texts:
        if tokenizer.backend.token_to_id(text) is None:
            raise JaxtuneError(f"the tokenizer has no {text} token (Llama 4's processor writes it for an image)")


def image_marker(tokenizer, vision: Llama4VisionConfig) -> str:
    """What Llama 4's chat template writes for an image part: `<|image|>`."""
    _checked(tokenizer, IMAGE_MARKER)
    return IMAGE_MARKER


def image_expansion(tokenizer, vision: Llama4VisionConfig, grid: tuple[int, int]) -> str:
    """Llama4Processor's text for an image of `grid` (rows, columns) tiles (`_prompt_split_image`)."""
    _checked(tokenizer, IMAGE_MARKER, IMAGE_START, IMAGE_END, PATCH, TILE_X, TILE_Y)
    if tokenizer.backend.token_to_id(PATCH) != vision.image_token_id:
        raise JaxtuneError(f"the tokenizer's {PATCH} is id {tokenizer.backend.token_to_id(PATCH)}, the model's "
                           f"config.json image_token_index {vision.image_token_id}")
    patches, (rows, cols) = PATCH * vision.tokens_per_tile, grid
    tiles = "".join(TILE_X.join([patches] * cols) + TILE_Y for _ in range(rows)) if rows * cols > 1 else ""
    return f"{IMAGE_START}{tiles}{IMAGE_MARKER}{patches}{IMAGE_END}"


def tower_bytes(vision: Llama4VisionConfig, shape: tuple[int, ...], arrays: int, itemsize: int) -> int:
    """Bytes the image side holds at once for `arrays` tiles, values of `itemsize` bytes: their pixels, one encoder
    layer's [N, P + 1, .] values (the residual, its LayerNorm, q, k, v, the attention's output: 6 x Dv; the MLP's two
    of F), the adapter's and the projector's outputs, and the attention kernel's float32 working set."""
    P = vision.patches_per_side**2 + 1
    K = vision.tokens_per_tile
    values = (int(np.prod(shape)) + P * (6 * vision.hidden_size + 2 * vision.intermediate_size)
              + K * (vision.projector_input_dim + vision.projector_output_dim + vision.text_hidden_size))
    return arrays * (values * itemsize + forward_block_bytes(P, vision.num_heads, vision.hidden_size))


def _pixel_shape(options: Llama4ImageOptions) -> tuple[int, int, int]:
    return 3, options.tile_size, options.tile_size


LLAMA4 = VisionFamily(
    name="llama4", architectures=("Llama4ForConditionalGeneration",), read_config=llama4_vision.read_config,
    param_specs=llama4_vision.param_specs, read_params=llama4_vision.read_params,
    tensor_entries=llama4_vision.tensor_entries, read_processing=read_options, pixels=image_tiles,
    pixel_shape=_pixel_shape, marker=image_marker, expansion=image_expansion,
    image_token=lambda vision: vision.image_token_id, image_inputs=image_inputs, forward=vision_language_forward,
    prefill=vision_language_prefill, text_prefix="language_model.model.",
    outside_text=r".*(vision_model|multi_modal_projector).*", forward_bytes=tower_bytes)
