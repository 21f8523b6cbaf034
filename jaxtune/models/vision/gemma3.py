"""Gemma 3's images in its text (transformers' `Gemma3ForConditionalGeneration`): `image_soft_tokens` (the SigLIP
tower's patch grid average-pooled to `tokens_per_image`, Gemma-RMSNormed, projected to the text's width) and
`vision_language_forward` (and `vision_language_prefill`, for decoding), the shared decoder with those tokens placed
over the image placeholders' scaled embeddings, unscaled, each image's tokens one bidirectional span inside the
causal and sliding masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, ModelConfig, VisionLanguageConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.kv_cache import KVCache, prefill
from jaxtune.models.llama import forward
from jaxtune.models.multimodal import PlacedEmbeddings, span_ids
from jaxtune.models.norms import rms_norm
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


def image_inputs(vision_params: dict, tokens_BxT: jax.Array, pixel_values_NxCxHxW: jax.Array, cfg: ModelConfig,
                 vision: VisionLanguageConfig, dtype) -> tuple[jax.Array, dict]:
    """(the tokens the text embeds [B, T], the decoder's image keywords: `placed_embeddings`, `span_ids_BxT`) of a
    text whose `vision.image_token_id` placeholders (tokens_per_image a picture, in order) take the soft tokens of
    the N images [N, C, H, W]. A placeholder past the vocabulary looks up token 0, as transformers'. Tokens known
    outside jit are checked to hold N x tokens_per_image placeholders (traced ones cannot be)."""
    if not isinstance(tokens_BxT, jax.core.Tracer):
        found, images = int(np.sum(np.asarray(tokens_BxT) == vision.image_token_id)), pixel_values_NxCxHxW.shape[0]
        if found != images * vision.tokens_per_image:
            raise JaxtuneError(f"{found} image placeholder tokens (id {vision.image_token_id}) for {images} images of "
                               f"{vision.tokens_per_image} soft tokens each")
    images_NxMxD = image_soft_tokens(vision_params, pixel_values_NxCxHxW, vision, dtype)
    at_BxT = tokens_BxT == vision.image_token_id
    placed = PlacedEmbeddings(images_NxMxD.reshape(-1, images_NxMxD.shape[-1]), at_BxT)
    return jnp.where(tokens_BxT < cfg.vocab_size, tokens_BxT, 0), dict(placed_embeddings=placed,
                                                                       span_ids_BxT=span_ids(at_BxT))


def vision_language_forward(params: dict, vision_params: dict, tokens_BxT: jax.Array,
                            pixel_values_NxCxHxW: jax.Array | None, cfg: ModelConfig, vision: VisionLanguageConfig,
                            *, options: ForwardOptions = ForwardOptions(), **kwargs) -> jax.Array:
    """Logits [B, T, V] (as `llama.forward`) of a text with N images [N, C, H, W] (`image_inputs`); None or N = 0:
    the text alone. Keyword arguments as for `llama.forward`; jit with `static_argnames=("cfg", "vision", ...)`."""
    if pixel_values_NxCxHxW is None or pixel_values_NxCxHxW.shape[0] == 0:
        return forward(params, tokens_BxT, cfg, options=options, **kwargs)
    text_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values_NxCxHxW, cfg, vision,
                                    jnp.dtype(options.compute_dtype))
    return forward(params, text_BxT, cfg, options=options, **kwargs, **images)


def vision_language_prefill(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values_NxCxHxW: jax.Array,
                            cfg: ModelConfig, vision: VisionLanguageConfig, *,
                            options: ForwardOptions = ForwardOptions(), **kwargs) -> tuple[jax.Array, KVCache]:
    """`kv_cache.prefill` of prompts with N images (`image_inputs`): logits [B, V] of the next token and the cache,
    which `kv_cache.decode_step` continues (the images live on in the cache's keys and values)."""
    text_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values_NxCxHxW, cfg, vision,
                                    jnp.dtype(options.compute_dtype))
    return prefill(params, text_BxT, cfg, options=options, **kwargs, **images)
