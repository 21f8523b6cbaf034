"""Rollouts from prompts with images (a vision-language policy; `decoders.sampled_groups` with `PromptImages`): each
sample's prompt left-padded to the longest, its pixel arrays beside it, prefilled by its family
(`VisionFamily.prefill`: the images' tokens over their placeholders, Gemma 3's bidirectional spans, Qwen2.5-VL's
M-RoPE positions counted from each prompt's first real token and decoding on from its largest + 1, transformers'
rope deltas), then decoded by `generation.decode_more` as text is: greedy tokens are transformers' `generate`'s."""

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
from jaxtune.generation import DecodeState, decode_more, row_tokens, split_rows
from jaxtune.models.kv_cache import prefix_length, refuse_context_axis
from jaxtune.models.vision.family import ImageSide
from jaxtune.parallel.distributed import host_copy
from jaxtune.stop_strings import StopStrings


@dataclass(frozen=True)
class PromptImages:
    """The images of a rollout's prompts: the run's image side (its tower's weights are the policy's
    `params["vision"]`) and each prompt's pixel arrays float32 [G, side.max_images, *side.pixel_shape], zeros past
    a prompt's own."""

    side: ImageSide
    pixels: np.ndarray

    @classmethod
    def of(cls, side: ImageSide, prompts: Sequence) -> PromptImages:
        """The images of `prompts` (each with `pixel_values` [n, *pixel_shape], n <= side.max_images)."""
        pixels: np.ndarray = np.zeros((len(prompts), side.max_images, *side.pixel_shape), np.float32)
        for i, prompt in enumerate(prompts):
            pixels[i, :len(prompt.pixel_values)] = prompt.pixel_values
        return cls(side, pixels)


@partial(jax.jit, static_argnames=("cfg", "side", "method", "options", "cache_size", "max_new_tokens"))
def begin_with_images(params, tokens_BxW, mask_BxW, pixels, live_B, limit_B, *, cfg: ModelConfig, side: ImageSide,
                      method: MethodConfig | None, options: ForwardOptions, cache_size: int,
                      max_new_tokens: int) -> DecodeState:
    """`generation.begin` for left-padded prompts [B, W] (mask 1 on real tokens) with each row's pixel arrays
    [B, M, ...]: the family's prefill of them, their positions counted from each row's first real token."""
    positions_BxW = jnp.maximum(jnp.cumsum(mask_BxW, axis=1) - 1, 0)
    logits_BxV, cache = side.family.prefill(params, jax.lax.stop_gradient(params["vision"]), tokens_BxW, pixels, cfg,
                                            side.config, attention_mask_BxT=mask_BxW, positions_BxT=positions_BxW,
                                            cache_size=cache_size, method=method, options=options)
    out_BxN = jnp.full((live_B.shape[0], max_new_tokens), -1, jnp.int32)
    return split_rows(DecodeState(jnp.asarray(0, jnp.int32), logits_BxV, cache, out_BxN, ~live_B | (limit_B < 1)))


def generate_with_images(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], images: PromptImages,
                         sampling: SamplingConfig, *, eos_ids: Sequence[int] | None, stop_token_ids: Sequence[int] = (),
                         method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
                         include_stop: bool = False, stop_when: Callable[[int, list[int]], bool] | None = None,
                         chunk_steps: int = 16) -> list[list[int]]:
    """`generation.generate` of prompts [n] whose pixel arrays are images.pixels [n, M, ...] (one a prompt), all
    decoded at once: the new tokens of each, as `generate` returns them (eos_ids, stop tokens, include_stop,
    stop_when and its chunks the same)."""
    refuse_context_axis()
    if prefix_length(params):
        raise JaxtuneError("prefix tuning with image prompts: the image rollout's positions count from each prompt's "
                           "first token, not after the prefix; use an adapter method without prefix tokens")
    n, N = len(prompts), sampling.max_new_tokens
    B, W = bucket(n), bucket(max(len(p) for p in prompts), MIN_BUCKET)
    tokens_BxW: np.ndarray = np.zeros((B, W), np.int32)
    mask_BxW: np.ndarray = np.zeros((B, W), np.int32)
    mask_BxW[n:, -1] = 1  # the rows padding the bucket hold one token, so that no query attends to nothing
    for i, prompt in enumerate(prompts):
        tokens_BxW[i, W - len(prompt):], mask_BxW[i, W - len(prompt):] = prompt, 1
    pixels: np.ndarray = np.zeros((B, *images.pixels.shape[1:]), np.float32)
    pixels[:n] = images.pixels
    stops = tuple(cfg.eos_token_id if eos_ids is None else eos_ids) + tuple(stop_token_ids)
    is_stop_V: np.ndarray = np.zeros(cfg.vocab_size, bool)
    is_stop_V[list(stops)] = True
    live_B, limit_B = np.arange(B) < n, np.where(np.arange(B) < n, N, 0).astype(np.int32)
    program = dict(cfg=cfg, method=method, options=options)
    state = begin_with_images(params, tokens_BxW, mask_BxW, pixels, live_B, limit_B, **program, side=images.side,
                              cache_size=W + N, max_new_tokens=N)
    sampling_args = (is_stop_V, np.float32(max(sampling.temperature, 1e-6)), np.int32(sampling.top_k),
                     np.float32(sampling.top_p), jax.random.key(sampling.seed))
    until = N if stop_when is None else min(chunk_steps, N)
    state = decode_more(params, state, limit_B, *sampling_args, np.int32(until), **program, greedy=sampling.greedy)
    while stop_when is not None and until < N:  # the host reads each chunk's tokens to end rows, as `generate`
        out_BxN, done_B = host_copy((state.out_BxN, state.done_B))
        done_B = done_B.copy()
        for row in np.flatnonzero(~done_B):
            done_B[row] = stop_when(int(row), row_tokens(out_BxN[row], is_stop_V, False))
        if done_B.all():
            break
        until = min(until + chunk_steps, N)
        state = decode_more(params, state._replace(done_B=done_B), limit_B, *sampling_args, np.int32(until),
                            **program, greedy=sampling.greedy)
    new_tokens = [row_tokens(row, is_stop_V, include_stop) for row in host_copy(state.out_BxN)[:n]]
    if isinstance(stop_when, StopStrings):
        return [stop_when.cut(i, tokens, include_stop) for i, tokens in enumerate(new_tokens)]
    return new_tokens
