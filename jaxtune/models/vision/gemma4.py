"""Gemma 4 as a vision family (`GEMMA4`, `family.py`), images only (an audio tower in the checkpoint is left; video
not read). Variable resolution with static shapes: an image is one pixel array [max_patches, 2 + 3 p²] — its
patches' (x, y), then their values, as `Gemma4ImageProcessorPil` gives them, padding rows at (-1, -1) — where
max_patches = max_soft_tokens x k² of preprocessor_config.json (the processor's own padding); the tower
(`gemma4_vision.soft_tokens`) runs inside the one jitted step and each image's n / k² soft tokens go to its run of
image tokens (the processor writes boi, that many image tokens, eoi). The text embeds those positions as the pad
token (transformers' per-layer inputs read it there). With `use_bidirectional_attention = "vision"` an image's
tokens see each other on sliding layers only (`multimodal.span_ids(sliding_only=True)`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jaxtune.config import ForwardOptions, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.models.attention import forward_block_bytes
from jaxtune.models.hf_config import load_config, model_dir
from jaxtune.models.kv_cache import KVCache, prefill
from jaxtune.models.llama import forward
from jaxtune.models.multimodal import PlacedEmbeddings, span_ids
from jaxtune.models.params import ParamSpec
from jaxtune.models.vision.family import VisionFamily
from jaxtune.models.vision.gemma4_vision import (
    Gemma4VisionConfig,
    abstract_params,
    read_params,
    soft_tokens,
    tensor_entries,
    vision_config_from_hf,
)
from jaxtune.models.vision.image_processing import PREPROCESSOR_FILE, rgb_array

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the max_soft_tokens Gemma4ImageProcessor accepts


@dataclass(frozen=True, kw_only=True)
class Gemma4VLConfig:
    """Gemma 4's image path: the tower, the placeholder ids, the pad id the text embeds at the image tokens, and
    whether an image's tokens attend bidirectionally on sliding layers (`use_bidirectional_attention = "vision"`)."""

    tower: Gemma4VisionConfig
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    pad_token_id: int = 0
    bidirectional: bool = False


@dataclass(frozen=True, kw_only=True)
class Gemma4ImageOptions:
    """Gemma4ImageProcessor's settings: each image RGB, resized (Pillow, `resample`, 3: bicubic) keeping its aspect
    ratio to the most patches of `patch_size` within max_soft_tokens x k² with sides multiples of k x patch_size,
    x rescale_factor, normalised only if `normalize`, cut into patches in row order (values in (row, column,
    channel) order)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = 3
    rescale_factor: float = 1 / 255
    normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


def read_config(directory) -> Gemma4VLConfig:
    """The image side of a Gemma4ForConditionalGeneration config.json (its text width from the text model)."""
    path = model_dir(directory)
    hf, text = read_json(path / "config.json"), load_config(path)
    mode = (hf.get("text_config") or {}).get("use_bidirectional_attention")
    if mode not in (None, "vision"):
        raise JaxtuneError(f"{path / 'config.json'}: text_config use_bidirectional_attention {mode!r} (jaxtune "
                           "computes None or 'vision')")
    default = Gemma4VLConfig(tower=vision_config_from_hf(hf, text.hidden_size, str(path / "config.json")))
    return Gemma4VLConfig(tower=default.tower, bidirectional=mode == "vision",
                          pad_token_id=int((hf.get("text_config") or {}).get("pad_token_id") or 0),
                          **{k: int(hf.get(k) or getattr(default, k)) for k in (
                              "image_token_id", "boi_token_id", "eoi_token_id")})


def read_processing(directory) -> Gemma4ImageOptions:
    """preprocessor_config.json's settings (absent keys: the processor's defaults); what the processor does not
    do here (a skipped resize or rescale, an unknown budget) is refused in one line."""
    path = model_dir(directory) / PREPROCESSOR_FILE
    if not path.is_file():
        raise JaxtuneError(f"{directory}: no {PREPROCESSOR_FILE} (the image processor's settings)")
    hf, default = read_json(path), Gemma4ImageOptions()
    if any(hf.get(step) is False for step in ("do_resize", "do_rescale", "do_convert_rgb")):
        raise JaxtuneError(f"{path}: jaxtune's Gemma 4 processor always converts to RGB, resizes and rescales")
    options = Gemma4ImageOptions(
        patch_size=int(hf.get("patch_size", default.patch_size)),
        max_soft_tokens=int(hf.get("max_soft_tokens", default.max_soft_tokens)),
        pooling_kernel_size=int(hf.get("pooling_kernel_size", default.pooling_kernel_size)),
        resample=int(hf.get("resample", default.resample)),
        rescale_factor=float(hf.get("rescale_factor", default.rescale_factor)),
        normalize=bool(hf.get("do_normalize", default.normalize)),
        image_mean=tuple(map(float, hf.get("image_mean") or default.image_mean)),
        image_std=tuple(map(float, hf.get("image_std") or default.image_std)))
    if options.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise JaxtuneError(f"{path}: max_soft_tokens {options.max_soft_tokens} (Gemma 4's are {SOFT_TOKEN_BUDGETS})")
    return options


def resized_size(height: int, width: int, options: Gemma4ImageOptions) -> tuple[int, int]:
    """(height, width) keeping the aspect ratio, sides multiples of k x patch, at most max_patches patches
    (`get_aspect_ratio_preserving_size`, its float arithmetic as written)."""
    p, k = options.patch_size, options.pooling_kernel_size
    factor = math.sqrt(options.max_patches * p**2 / (height * width))
    side = k * p
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise JaxtuneError(f"an image of {height} x {width} resizes to 0 x 0 patches")
    longest = options.max_patches // k**2 * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    return h, w


def image_arrays(images, options: Gemma4ImageOptions) -> tuple[np.ndarray, list[int]]:
    """(float32 [N, max_patches, 2 + 3 p²]: each image's patches' (x, y) then values, padding rows (-1, -1) and
    zeros; each image's soft tokens, patches / k²) — `Gemma4ImageProcessorPil`'s pixel_values and
    image_position_ids side by side."""
    p = options.patch_size
    out: np.ndarray = np.zeros((len(images), options.max_patches, 2 + 3 * p * p), np.float32)
    out[:, :, :2] = -1
    counts = []
    for i, image in enumerate(images):
        pixels = rgb_array(image)
        h, w = resized_size(pixels.shape[1], pixels.shape[2], options)
        if (h, w) != pixels.shape[1:]:
            pixels = np.moveaxis(np.array(Image.fromarray(np.moveaxis(pixels, 0, -1)).resize(
                (w, h), resample=Image.Resampling(options.resample))), -1, 0)
        values = (pixels.astype(np.float64) * options.rescale_factor).astype(np.float32)
        if options.normalize:
            mean, std = (np.asarray(v, np.float32)[:, None, None] for v in (options.image_mean, options.image_std))
            values = (values - mean) / std
        n = (h // p) * (w // p)
        out[i, :n, 2:] = values.reshape(3, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0).reshape(n, -1)
        out[i, :n, :2] = np.stack(np.meshgrid(np.arange(w // p), np.arange(h // p), indexing="xy"), -1).reshape(n, 2)
        counts.append(n // options.pooling_kernel_size**2)
    return out, counts


def image_inputs(vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array, positions_BxT: jax.Array | None,
                 cfg: ModelConfig, vision: Gemma4VLConfig, dtype) -> tuple[jax.Array, dict]:
    """(tokens [B, T] with the image tokens as the pad token, the decoder's keywords) of rows whose `image_token_id`
    runs take the images, [N, max_patches, K] in row-major order over the batch or each row's own [B, M, ...]
    (a row's unused slots, zeros after its images, are never placed)."""
    del cfg, dtype  # the tower computes in its weights' dtype, as transformers'
    B, T = tokens_BxT.shape
    per_row = pixel_values.ndim == 4
    images = pixel_values.reshape(-1, *pixel_values.shape[-2:])
    tokens_IxSxD = soft_tokens(vision_params, images, vision.tower, vision_params["input_proj"].dtype)
    counts_I = jnp.sum(jnp.any(images[..., :2] != -1, axis=-1), axis=1) // vision.tower.pooling_kernel_size**2
    R = B if per_row else 1
    counts_RxM = counts_I.reshape(R, -1)
    at_BxT = tokens_BxT == vision.image_token_id
    at_RxL = at_BxT.reshape(R, -1)
    ends_RxM = jnp.cumsum(counts_RxM, axis=1)
    before_RxL = jnp.cumsum(at_RxL, axis=1) - at_RxL  # image tokens before each token
    image_RxL = jnp.minimum(jnp.sum(before_RxL[..., None] >= ends_RxM[:, None], -1), counts_RxM.shape[1] - 1)
    k_RxL = before_RxL - jnp.take_along_axis(ends_RxM - counts_RxM, image_RxL, axis=1)
    index_BxT = (jnp.arange(R)[:, None] * counts_RxM.shape[1] + image_RxL).reshape(B, T)
    vectors_BxTxD = tokens_IxSxD[index_BxT, jnp.clip(k_RxL, 0, tokens_IxSxD.shape[1] - 1).reshape(B, T)]
    order_BxT = jnp.argsort(~at_BxT, axis=1, stable=True)  # each row's marked tokens first, in order
    placed = PlacedEmbeddings(jnp.take_along_axis(vectors_BxTxD, order_BxT[..., None], axis=1), at_BxT)
    spans = span_ids(at_BxT, sliding_only=True) if vision.bidirectional else None
    return jnp.where(at_BxT, vision.pad_token_id, tokens_BxT), dict(
        positions_BxT=positions_BxT, placed_embeddings=placed, span_ids_BxT=spans)


def vision_language_forward(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array | None,
                            cfg: ModelConfig, vision: Gemma4VLConfig, *, options: ForwardOptions = ForwardOptions(),
                            **kwargs) -> jax.Array:
    """Logits [B, T, V] of a text with images (`image_inputs`' pixel arrays; None: the text alone), keyword
    arguments as for `llama.forward`."""
    if pixel_values is None or pixel_values.shape[0] == 0:
        return forward(params, tokens_BxT, cfg, options=options, **kwargs)
    tokens_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values, kwargs.pop("positions_BxT", None), cfg,
                                      vision, None)
    return forward(params, tokens_BxT, cfg, options=options, **kwargs, **images)


def vision_language_prefill(params: dict, vision_params: dict, tokens_BxT: jax.Array, pixel_values: jax.Array,
                            cfg: ModelConfig, vision: Gemma4VLConfig, *, options: ForwardOptions = ForwardOptions(),
                            **kwargs) -> tuple[jax.Array, KVCache]:
    """`kv_cache.prefill` of prompts with images: logits [B, V] of the next token and the cache, which
    `kv_cache.decode_step` continues."""
    tokens_BxT, images = image_inputs(vision_params, tokens_BxT, pixel_values, kwargs.pop("positions_BxT", None), cfg,
                                      vision, None)
    return prefill(params, tokens_BxT, cfg, options=options, **kwargs, **images)


def _token(tokenizer, token_id: int, what: str) -> str:
    text = tokenizer.backend.id_to_token(token_id)
    if text is None:
        raise JaxtuneError(f"the tokenizer has no {what} token (id {token_id}) of the model's config.json")
    return text


def image_expansion(tokenizer, vision: Gemma4VLConfig, count: int) -> str:
    """Gemma4Processor's text for an image of `count` soft tokens: boi, count x the image token, eoi."""
    return (_token(tokenizer, vision.boi_token_id, "begin-of-image")
            + _token(tokenizer, vision.image_token_id, "image") * count
            + _token(tokenizer, vision.eoi_token_id, "end-of-image"))


def tower_bytes(vision: Gemma4VLConfig, shape: tuple[int, ...], arrays: int, itemsize: int) -> int:
    """Bytes the image side holds at once for `arrays` padded images, values of `itemsize` bytes: their pixels, one
    layer's [P, .] values (the residual, its norm, q, k, v, the attention's output: 6 x D; the gated MLP's three of
    F), the soft tokens, and the attention kernel's float32 working set."""
    t, P = vision.tower, shape[0]
    values = (P * shape[1] + P * (6 * t.hidden_size + 3 * t.intermediate_size)
              + P // t.pooling_kernel_size**2 * t.text_hidden_size)
    return arrays * (values * itemsize + forward_block_bytes(P, t.num_heads, t.num_heads * t.head_dim))


GEMMA4 = VisionFamily(
    name="gemma4", architectures=("Gemma4ForConditionalGeneration",), read_config=read_config,
    param_specs=lambda vision: jax.tree.map(lambda s: ParamSpec(s.shape, (None,) * len(s.shape)),
                                            abstract_params(vision.tower)),
    read_params=lambda directory, vision, dtype: read_params(Path(directory), vision.tower, dtype),
    tensor_entries=lambda params, vision, dtype: tensor_entries(params, vision.tower, dtype),
    read_processing=read_processing, pixels=image_arrays,
    pixel_shape=lambda options: (options.max_patches, 2 + 3 * options.patch_size**2),
    marker=lambda tokenizer, vision: _token(tokenizer, vision.image_token_id, "image"),
    expansion=image_expansion, image_token=lambda vision: vision.image_token_id, image_inputs=image_inputs,
    forward=vision_language_forward, prefill=vision_language_prefill, text_prefix="model.language_model.",
    outside_text=r".*(vision_tower|embed_vision|audio_tower|embed_audio).*", forward_bytes=tower_bytes,
    image_spans=True)
