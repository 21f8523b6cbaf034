"""Decoding prompts with images (a vision-language model), the one padded decode that GRPO/RLOO's rollouts
(`rollouts.decoders.sampled_groups`) and `image_generation` (`jaxtune generate --image`, the lm-eval harness) both
run: prompts left-padded to bucketed shapes, each row's pixel arrays beside it, prefilled by the family
(`VisionFamily.prefill`: the images' tokens over their placeholders, Gemma 3's bidirectional spans, Qwen2.5-VL's
M-RoPE positions counted from each prompt's first real token and transformers' rope deltas), then decoded by
`generation.decode_rows` as text is: greedy tokens are transformers' `generate`'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.errors import JaxtuneError
from jaxtune.generation import DecodeState, decode_rows, split_rows
from jaxtune.models.kv_cache import prefill, prefix_length, refuse_context_axis
from jaxtune.models.vision.family import ImageSide


@dataclass(frozen=True)
class PromptImages:
    """The images of prompts decoded together: the image side (family, its config, M = side.max_images pixel arrays
    a row) and each prompt's pixel arrays float32 [n, M, *side.pixel_shape], zeros past a prompt's own. M = 0: no
    prompt has an image (a plain prefill)."""

    side: ImageSide
    pixels: np.ndarray

    @classmethod
    def of(cls, side: ImageSide, pixel_arrays: Sequence[np.ndarray]) -> PromptImages:
        """The images of prompts with pixel arrays `pixel_arrays` (each [k, *pixel_shape], k <= side.max_images)."""
        pixels: np.ndarray = np.zeros((len(pixel_arrays), side.max_images, *side.pixel_shape), np.float32)
        for i, own in enumerate(pixel_arrays):
            pixels[i, :len(own)] = own
        return cls(side, pixels)


def padded_rows(prompts: Sequence[Sequence[int]], pixels_NxMx: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens_BxW, mask_BxW, pixels_BxMx) of n prompts and their pixel arrays [n, M, ...]: rows and width in
    power-of-two buckets (width at least `MIN_BUCKET`), prompts left-padded with 0 (mask 1 on their tokens). The rows
    filling the bucket hold one token and zero images, so that no query of theirs attends to nothing."""
    n = len(prompts)
    B, W = bucket(n), bucket(max(len(p) for p in prompts), MIN_BUCKET)
    tokens_BxW: np.ndarray = np.zeros((B, W), np.int32)
    mask_BxW: np.ndarray = np.zeros((B, W), np.int32)
    mask_BxW[n:, -1] = 1
    for i, prompt in enumerate(prompts):
        tokens_BxW[i, W - len(prompt):], mask_BxW[i, W - len(prompt):] = prompt, 1
    pixels_BxMx: np.ndarray = np.zeros((B, *pixels_NxMx.shape[1:]), np.float32)
    pixels_BxMx[:n] = pixels_NxMx
    return tokens_BxW, mask_BxW, pixels_BxMx


@partial(jax.jit, static_argnames=("cfg", "side", "method", "options", "cache_size", "max_new_tokens"))
def begin_with_images(params, vision_params, tokens_BxW, mask_BxW, pixels_BxMx, limit_B, *, cfg: ModelConfig,
                      side: ImageSide, method: MethodConfig | None, options: ForwardOptions, cache_size: int,
                      max_new_tokens: int) -> DecodeState:
    """`generation.begin` for left-padded prompts [B, W] (mask 1 on real tokens) with each row's pixel arrays
    [B, M, ...]: the family's prefill of them (a plain one for M = 0), positions counted from each row's first real
    token; rows split over the mesh's batch axes. A row with limit_B 0 starts finished."""
    if side.max_images == 0:
        logits_BxV, cache = prefill(params, tokens_BxW, cfg, mask_BxW, cache_size=cache_size, method=method,
                                    options=options)
    else:
        positions_BxW = jnp.maximum(jnp.cumsum(mask_BxW, axis=1) - 1, 0)
        logits_BxV, cache = side.family.prefill(params, jax.lax.stop_gradient(vision_params), tokens_BxW, pixels_BxMx,
                                                cfg, side.config, attention_mask_BxT=mask_BxW,
                                                positions_BxT=positions_BxW, cache_size=cache_size, method=method,
                                                options=options)
    out_BxN = jnp.full((tokens_BxW.shape[0], max_new_tokens), -1, jnp.int32)
    return split_rows(DecodeState(jnp.asarray(0, jnp.int32), logits_BxV, cache, out_BxN, limit_B < 1))


def decode_with_images(params: dict, vision_params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                       images: PromptImages, sampling: SamplingConfig, *, eos_ids: Sequence[int] | None,
                       stop_token_ids: Sequence[int] = (), method: MethodConfig | None = None,
                       options: ForwardOptions = ForwardOptions(), include_stop: bool = False,
                       stop_when: Callable[[int, list[int]], bool] | None = None,
                       chunk_steps: int = 16) -> list[list[int]]:
    """`generation.generate` of prompts [n] (token ids, images' placeholders expanded) whose pixel arrays are
    images.pixels [n, M, ...], all decoded at once with the image tower's `vision_params`: the new tokens of each,
    as `generate` returns them (eos_ids, default the model's; stop tokens, include_stop, stop_when and its chunks,
    `StopStrings` cutting the same). Raises JaxtuneError for no prompts, an empty one, one that with
    `max_new_tokens` would pass the model's context, prefix tuning, or a mesh with a context axis."""
    refuse_context_axis()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise JaxtuneError("generation with images needs at least one prompt, each of at least one token")
    N, context = sampling.max_new_tokens, cfg.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) + N > context:
            raise JaxtuneError(f"prompt {i} has {len(prompt)} tokens with its images: with max_new_tokens={N} it "
                               f"would pass the model's context of {context} (max_position_embeddings)")
    if prefix_length(params):
        raise JaxtuneError("prefix tuning with image prompts: their positions count from each prompt's first token, "
                           "not after the prefix; use an adapter method without prefix tokens")
    tokens_BxW, mask_BxW, pixels_BxMx = padded_rows(prompts, images.pixels)
    stops = tuple(cfg.eos_token_id if eos_ids is None else eos_ids) + tuple(stop_token_ids)
    is_stop_V: np.ndarray = np.zeros(cfg.vocab_size, bool)
    is_stop_V[list(stops)] = True
    limit_B = np.where(np.arange(len(tokens_BxW)) < len(prompts), N, 0).astype(np.int32)  # padding rows: none
    state = begin_with_images(params, vision_params, tokens_BxW, mask_BxW, pixels_BxMx, limit_B, cfg=cfg,
                              side=images.side, method=method, options=options, cache_size=tokens_BxW.shape[1] + N,
                              max_new_tokens=N)
    return decode_rows(params, state, limit_B, is_stop_V, sampling, cfg=cfg, method=method, options=options,
                       prompt_of_row=range(len(prompts)), include_stop=include_stop, stop_when=stop_when,
                       chunk_steps=chunk_steps)
