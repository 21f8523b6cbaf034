"""Gemma 3's images in its text (transformers' `Gemma3ForConditionalGeneration`): `image_soft_tokens` (the SigLIP
tower's patch grid average-pooled to `tokens_per_image`, Gemma-RMSNormed, projected to the text's width) and
`vision_language_forward` (and `vision_language_prefill`, for decoding), the shared decoder with those tokens placed
over the image placeholders' scaled embeddings, unscaled, each image's tokens one bidirectional span inside the
causal and sliding masks. `GEMMA3` is its vision family (`family.py`): Gemma3Processor's text and pixels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, ModelConfig, VisionLanguageConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.attention import forward_block_bytes
from jaxtune.models.kv_cache import KVCache, prefill
from jaxtune.models.llama import forward
from jaxtune.models.multimodal import PlacedEmbeddings, span_ids
from jaxtune.models.norms import rms_norm
from jaxtune.models.vision.family import VisionFamily, VisionPart
from jaxtune.models.vision.hf import (
    LAYER_LINEARS,
    load_vision_config,
    read_vision_params,
    vision_param_specs,
    vision_tensor_entries,
)
from jaxtune.models.vision.image_processing import pixel_values, read_image_processing
from jaxtune.models.vision.siglip import siglip_tower


def project_patches(projector: dict, patches_NxPxD: jax.Array, cfg: VisionLanguageConfig) -> jax.Array:
    """[N, M, D_text]: the patch grid [N, P, Dv] average-pooled in squares of `cfg.pooling` patches (row-major),
    RMSNormed with (1 + weight) and the tower's epsilon, times `mm_input_projection` [Dv, D_text]."""
    N, P, Dv = patches_NxPxD.shape
    side, k = cfg.tower.patches_per_side, cfg.pooling
    grid = patches_NxPxD.reshape(N, side // k, k, side // k, k, Dv)
    pooled_NxMxD = jnp.mean(grid, axis=(2, 4)).reshape(N, -1, Dv)
    normed_NxMxD = rms_norm(pooled_NxMxD, projector["mm_soft_emb_norm"], cfg.tower.layer_norm_eps, unit_offset=True)
    return normed_NxMxD @ projector["mm_input_projection"].astype(normed_NxMxD.dtype)


def image_soft_tokens(vision_params: dict, pixel_values_NxCxHxW: jax.Array, cfg: VisionLanguageConfig,
                      dtype=jnp.float32) -> jax.Array:
    """[N, tokens_per_image, D_text] in `dtype`: what N preprocessed images (`image_processing.pixel_values`) put
    in the text."""
    patches_NxPxD = siglip_tower(vision_params["vision_tower"], pixel_values_NxCxHxW, cfg.tower, dtype)
    return project_patches(vision_params["multi_modal_projector"], patches_NxPxD, cfg)


def image_inputs(vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array, positions_BxT: jax.Array | None,
                 cfg: ModelConfig, vision: VisionLanguageConfig, dtype) -> tuple[jax.Array, dict]:
    """(the tokens the text embeds [B, T], the decoder's keywords: `positions_BxT` as given (None: the decoder's
    default), `placed_embeddings`, `span_ids_BxT`) of a
    text whose `vision.image_token_id` placeholders (tokens_per_image a picture, in order) take the soft tokens of
    the images: N of them [N, C, H, W] in row-major order over the batch, or each row's own [B, M, C, H, W] (a
    training batch: M the most a row holds, padding images never placed). A placeholder past the vocabulary looks
    up token 0, as transformers'. Tokens known outside jit are checked to hold N x tokens_per_image placeholders
    (traced ones, or padded rows, cannot be)."""
    if not isinstance(tokens_BxT, jax.core.Tracer) and pixel_values.ndim == 4:
        found, images = int(np.sum(np.asarray(tokens_BxT) == vision.image_token_id)), pixel_values.shape[0]
        if found != images * vision.tokens_per_image:
            raise JaxtuneError(f"{found} image placeholder tokens (id {vision.image_token_id}) for {images} images of "
                               f"{vision.tokens_per_image} soft tokens each")
    flat_NxCxHxW = pixel_values.reshape(-1, *pixel_values.shape[-3:])
    images_NxMxD = image_soft_tokens(vision_params, flat_NxCxHxW, vision, dtype)
    D = images_NxMxD.shape[-1]
    vectors = images_NxMxD.reshape(-1, D) if pixel_values.ndim == 4 else images_NxMxD.reshape(
        pixel_values.shape[0], -1, D)
    at_BxT = tokens_BxT == vision.image_token_id
    placed = PlacedEmbeddings(vectors, at_BxT)
    return jnp.where(tokens_BxT < cfg.vocab_size, tokens_BxT, 0), dict(
        positions_BxT=positions_BxT, placed_embeddings=placed, span_ids_BxT=span_ids(at_BxT))


def vision_language_forward(params: dict, vision_params: dict, tokens_BxT: jax.Array,
                            pixel_values_NxCxHxW: jax.Array | None, cfg: ModelConfig, vision: VisionLanguageConfig,
                            *, options: ForwardOptions = ForwardOptions(), **kwargs) -> jax.Array:
    """Logits [B, T, V] (as `llama.forward`) of a text with N images [N, C, H, W] (`image_inputs`); None or N = 0:
    the text alone. Keyword arguments as for `llama.forward`; jit with `static_argnames=("cfg", "vision", ...)`."""
    if pixel_values_NxCxHxW is None or pixel_values_NxCxHxW.shape[0] == 0:
        return forward(params, tokens_BxT, cfg, options=options, **kwargs)
    text_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values_NxCxHxW, kwargs.pop("positions_BxT", None),
                                    cfg, vision, jnp.dtype(options.compute_dtype))
    return forward(params, text_BxT, cfg, options=options, **kwargs, **images)


def vision_language_prefill(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values_NxCxHxW: jax.Array,
                            cfg: ModelConfig, vision: VisionLanguageConfig, *,
                            options: ForwardOptions = ForwardOptions(), **kwargs) -> tuple[jax.Array, KVCache]:
    """`kv_cache.prefill` of prompts with N images (`image_inputs`): logits [B, V] of the next token and the cache,
    which `kv_cache.decode_step` continues (the images live on in the cache's keys and values)."""
    text_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values_NxCxHxW, kwargs.pop("positions_BxT", None),
                                    cfg, vision, jnp.dtype(options.compute_dtype))
    return prefill(params, text_BxT, cfg, options=options, **kwargs, **images)


def _token(tokenizer, token_id: int | None, what: str) -> str:
    text = tokenizer.backend.id_to_token(token_id) if token_id is not None else None
    if text is None:
        raise JaxtuneError(f"the tokenizer has no {what} token (id {token_id}) of the model's config.json")
    return text


def image_marker(tokenizer, vision: VisionLanguageConfig) -> str:
    """What Gemma 3's chat template writes for an image part: the begin-of-image token (`<start_of_image>`)."""
    return _token(tokenizer, vision.boi_token_id, "begin-of-image")


def image_expansion(tokenizer, vision: VisionLanguageConfig, arrays: int) -> str:
    """Gemma3Processor's text for one image of `arrays` pixel arrays (the whole image, then pan-and-scan's crops):
    "\n\n" boi, tokens_per_image x the image token, eoi "\n\n", crops introduced as the processor does."""
    soft = _token(tokenizer, vision.image_token_id, "image") * vision.tokens_per_image
    full = f"\n\n{image_marker(tokenizer, vision)}{soft}{_token(tokenizer, vision.eoi_token_id, 'end-of-image')}\n\n"
    if arrays == 1:
        return full
    return f"Here is the original image {full} and here are some crops to help you see better " + " ".join(
        [full] * (arrays - 1))


def tower_bytes(vision: VisionLanguageConfig, shape: tuple[int, ...], arrays: int, itemsize: int,
                saved: bool = False) -> int:
    """Bytes the image side holds at once for `arrays` images, values of `itemsize` bytes: their pixels, one encoder
    layer's [N, P, .] values (the residual, its LayerNorm, q, k, v, the attention's output: 6 x Dv; the MLP's two of
    F; `saved`: beside them every layer's input [N, P, Dv], what a trained tower's rematerialised backward keeps), the
    soft tokens [N, tokens_per_image, D] it hands the decoder, and the attention kernel's float32 working set
    (`attention.forward_block_bytes`)."""
    t = vision.tower
    P = t.patches_per_side**2
    pixels = t.num_channels * t.image_size**2
    inputs = t.num_layers * P * t.hidden_size if saved else 0
    values = (pixels + inputs + P * (6 * t.hidden_size + 2 * t.intermediate_size)
              + vision.tokens_per_image * vision.text_hidden_size)
    return arrays * (values * itemsize + forward_block_bytes(P, t.num_heads, t.hidden_size))


def _pixels(images, processing) -> tuple[np.ndarray, list[int]]:
    values, crops = pixel_values(images, processing)
    return values, [1 + n for n in crops]


GEMMA3 = VisionFamily(
    name="gemma3", architectures=("Gemma3ForConditionalGeneration",), read_config=load_vision_config,
    param_specs=vision_param_specs, read_params=read_vision_params, tensor_entries=vision_tensor_entries,
    read_processing=read_image_processing, pixels=_pixels,
    pixel_shape=lambda p: (3 if p.convert_rgb else 1, p.height, p.width),
    marker=image_marker, expansion=image_expansion,
    image_token=lambda v: v.image_token_id,
    image_inputs=image_inputs, forward=vision_language_forward, prefill=vision_language_prefill,
    text_prefix="model.language_model.",
    outside_text=r".*(vision_tower|multi_modal_projector).*", forward_bytes=tower_bytes, image_spans=True,
    parts={"vision_tower": VisionPart(keys=("vision_tower",), linears={
        ("vision_tower", "layers", name): f"model.vision_tower.encoder.layers.{{i}}.{name}" for name in LAYER_LINEARS}),
        # mm_input_projection is a bare nn.Parameter in transformers, no Linear PEFT adapts: the projector trains whole
        "multi_modal_projector": VisionPart(keys=("multi_modal_projector",), saved="multi_modal_projector")})
