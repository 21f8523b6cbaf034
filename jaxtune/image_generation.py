"""Generation with images (a vision-language model; its family's `ImageProcessor` and `prefill`): prompts, each with
its own images placed by the chat template's image markers expanded as the processor does, decoded together. A batch
is padded to static shapes (rows and widths in power-of-two buckets, prompts left-padded, each row's images
[rows, M, *pixel_shape] with padding images never placed), prefilled into a KV cache by the family (the images'
tokens, Gemma 3's bidirectional spans, Qwen2.5-VL's M-RoPE positions from each prompt's first real token), then
decoded by `generation.decode_more` (one `lax.while_loop`; greedy, or sampled as `generation` samples).
`load_image_generator` reads what it needs from a model directory (and a PEFT adapter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.data.formats import render_chat
from jaxtune.data.image_examples import expand_images
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import DecodeState, decode_more, row_tokens
from jaxtune.models.kv_cache import prefill
from jaxtune.models.vision.families import image_processor
from jaxtune.models.vision.family import ImageProcessor
from jaxtune.spine.model import load_model_with_adapter


@dataclass(frozen=True)
class ImageGenerator:
    """A vision-language model held for generation: the text model (and its adapter's method), the image side."""

    cfg: ModelConfig
    params: dict
    vision_params: dict
    processor: ImageProcessor
    method: MethodConfig | None = None


@dataclass(frozen=True)
class ImageBatch:
    """Prompts with images padded to static shapes: tokens_BxW (left-padded with 0), mask_BxW (1: a prompt's token),
    pixels_BxMx... (row b's images first, zeros after; M = 0 when no prompt has one), live_B (rows holding a
    prompt; the others repeat the first and start finished)."""

    tokens_BxW: np.ndarray
    mask_BxW: np.ndarray
    pixels_BxMx: np.ndarray
    live_B: np.ndarray


def load_image_generator(model: str | Path, adapter: str | Path | None = None, base: str = "as-trained",
                         log=None) -> ImageGenerator:
    """The text model of a vision-language directory (with a PEFT adapter, as `load_model_with_adapter`) and its
    image side, in the checkpoint's dtype."""
    processor = image_processor(model, load_tokenizer(model))
    if processor is None:
        raise JaxtuneError(f"{model}: reads no images (not a vision-language model jaxtune computes)")
    cfg, params, method = load_model_with_adapter(model, adapter, base=base, log=log)
    vision = processor.family.read_params(model, processor.config, params["embed_tokens"].dtype)
    return ImageGenerator(cfg, params, vision, processor, method)


def prompt_ids(processor: ImageProcessor, prompt: str | list[dict], images: Sequence[Image.Image]
               ) -> tuple[list[int], np.ndarray]:
    """(token ids, pixel arrays [N, ...]) of a prompt as the processor writes it: a text prompt becomes one user
    turn with the images before the text; a conversation's image parts take the images in order. Rendered by the
    chat template with the generation prompt."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": prompt}]}]
    return text_ids(processor, render_chat(prompt, processor.tokenizer, add_generation_prompt=True), images)


def text_ids(processor: ImageProcessor, text: str, images: Sequence[Image.Image], add_special_tokens: bool = False
             ) -> tuple[list[int], np.ndarray]:
    """(token ids, pixel arrays [N, ...]) of a text whose i-th image marker (`processor.marker`) stands for images[i],
    each expanded as the processor does; one error line when the counts differ."""
    pixels, expansions = processor(images)
    text, _, _ = expand_images(text, [], processor.marker, expansions, "prompt")
    return processor.tokenizer.encode(text, add_special_tokens=add_special_tokens), pixels


def image_batch(prompts: Sequence[tuple[Sequence[int], np.ndarray]], pixel_shape: tuple[int, ...]) -> ImageBatch:
    """The `ImageBatch` of (ids, pixel arrays [N, *pixel_shape]) prompts: rows, width and images a row in
    power-of-two buckets (width at least `MIN_BUCKET`), so that batches of similar sizes share one program."""
    if not prompts or any(len(ids) == 0 for ids, _ in prompts):
        raise JaxtuneError("generation with images needs at least one prompt, each of at least one token")
    B, W = bucket(len(prompts)), bucket(max(len(ids) for ids, _ in prompts), MIN_BUCKET)
    most = max(len(pixels) for _, pixels in prompts)
    M = bucket(most) if most else 0
    tokens: np.ndarray = np.zeros((B, W), np.int32)
    mask: np.ndarray = np.zeros((B, W), np.int32)
    pixels_BxMx: np.ndarray = np.zeros((B, M, *pixel_shape), np.float32)
    for row in range(B):
        ids, pixels = prompts[row if row < len(prompts) else 0]
        tokens[row, W - len(ids):], mask[row, W - len(ids):] = ids, 1
        pixels_BxMx[row, :len(pixels)] = pixels
    return ImageBatch(tokens, mask, pixels_BxMx, np.arange(B) < len(prompts))


@partial(jax.jit, static_argnames=("cfg", "processor", "cache_size", "max_new_tokens", "method", "options"))
def _begin(params, vision_params, tokens_BxW, mask_BxW, pixels_BxMx, live_B, *, cfg, processor, cache_size,
           max_new_tokens, method, options) -> DecodeState:
    """The decode state before the first new token: the left-padded prompts and their images prefilled."""
    keywords = dict(cache_size=cache_size, method=method, options=options)
    if pixels_BxMx.shape[1] == 0:
        logits_BxV, cache = prefill(params, tokens_BxW, cfg, mask_BxW, **keywords)
    else:  # plain positions from each prompt's first token: Qwen2.5-VL's M-RoPE starts there
        positions_BxW = jnp.maximum(jnp.cumsum(mask_BxW, axis=1) - 1, 0)
        logits_BxV, cache = processor.family.prefill(params, vision_params, tokens_BxW, pixels_BxMx, cfg,
                                                     processor.config, attention_mask_BxT=mask_BxW,
                                                     positions_BxT=positions_BxW, **keywords)
    out_BxN = jnp.full((tokens_BxW.shape[0], max_new_tokens), -1, jnp.int32)
    return DecodeState(jnp.asarray(0, jnp.int32), logits_BxV, cache, out_BxN, ~live_B)


def generate_batch_with_images(generator: ImageGenerator, prompts: Sequence[tuple[Sequence[int], np.ndarray]],
                               sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (),
                               options: ForwardOptions = ForwardOptions(),
                               stop_when: Callable[[int, list[int]], bool] | None = None, chunk_steps: int = 16
                               ) -> list[list[int]]:
    """Each prompt's new tokens, decoded together: up to `sampling.max_new_tokens`, ending with the first of
    `eos_ids` (kept). prompts: (token ids, pixel arrays [N, *pixel_shape]) as `prompt_ids` gives them (N x the
    family's tokens an image in placeholders). Greedy, a prompt's tokens are those it gets alone.
    stop_when(prompt index, its new tokens so far), as `generation.generate`'s: asked on the host every
    `chunk_steps` steps for each row still running; True ends that row (its tokens run to the end of the chunk).
    A prompt that with `max_new_tokens` would pass the model's context is one error line."""
    g, N = generator, sampling.max_new_tokens
    context = g.cfg.max_position_embeddings
    for i, (ids, _) in enumerate(prompts):
        if len(ids) + N > context:
            raise JaxtuneError(f"prompt {i} has {len(ids)} tokens with its images: with max_new_tokens={N} it would "
                               f"pass the model's context of {context} (max_position_embeddings)")
    batch = image_batch(prompts, g.processor.pixel_shape)
    program = dict(cfg=g.cfg, method=g.method, options=options)
    state = _begin(g.params, g.vision_params, batch.tokens_BxW, batch.mask_BxW, batch.pixels_BxMx, batch.live_B,
                   processor=g.processor, cache_size=batch.tokens_BxW.shape[1] + N, max_new_tokens=N, **program)
    is_stop_V: np.ndarray = np.zeros(g.cfg.vocab_size, bool)
    is_stop_V[list(eos_ids)] = True
    limit_B: np.ndarray = np.full(len(batch.live_B), N, np.int32)
    sampling_args = (is_stop_V, np.float32(max(sampling.temperature, 1e-6)), np.int32(sampling.top_k),
                     np.float32(sampling.top_p), jax.random.key(sampling.seed))
    until = N if stop_when is None else min(chunk_steps, N)
    state = decode_more(g.params, state, limit_B, *sampling_args, np.int32(until), **program, greedy=sampling.greedy)
    while stop_when is not None and until < N:  # the host reads each chunk's tokens (one transfer) to end rows
        out_BxN, done_B = jax.device_get((state.out_BxN, state.done_B))
        done_B = done_B.copy()
        for row in np.flatnonzero(~done_B):
            done_B[row] = stop_when(int(row), row_tokens(out_BxN[row], is_stop_V, False))
        if done_B.all():
            break
        until = min(until + chunk_steps, N)
        state = decode_more(g.params, state._replace(done_B=done_B), limit_B, *sampling_args, np.int32(until),
                            **program, greedy=sampling.greedy)
    return [row_tokens(row, is_stop_V, include_stop=True) for row in np.asarray(state.out_BxN)[:len(prompts)]]


def generate_ids_with_images(generator: ImageGenerator, ids: Sequence[int], pixels: np.ndarray,
                             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (),
                             options: ForwardOptions = ForwardOptions()) -> list[int]:
    """`generate_batch_with_images` of one prompt: its new tokens."""
    return generate_batch_with_images(generator, [(ids, pixels)], sampling, eos_ids, options)[0]


def eos_ids(generator: ImageGenerator) -> list[int]:
    """The model's EOS ids and the tokenizer's."""
    tokenizer = generator.processor.tokenizer
    return sorted({*generator.cfg.eos_token_id, *([tokenizer.eos_id] if tokenizer.eos_id is not None else [])})


def generate_texts_with_images(generator: ImageGenerator, prompts: Sequence[str | list[dict]],
                               images: Sequence[Sequence[Image.Image]], sampling: SamplingConfig = SamplingConfig(),
                               options: ForwardOptions = ForwardOptions(), batch_rows: int = 16) -> list[str]:
    """The text the model answers each prompt (text, or a conversation with image parts) about its own images
    with, `batch_rows` prompts decoded together, up to its EOS (the model's or the tokenizer's) or
    `sampling.max_new_tokens`."""
    if len(prompts) != len(images):
        raise JaxtuneError(f"{len(prompts)} prompts but {len(images)} image lists: give each prompt its own")
    eos = eos_ids(generator)
    ids = [prompt_ids(generator.processor, prompt, own) for prompt, own in zip(prompts, images)]
    new = [tokens for at in range(0, len(ids), batch_rows)
           for tokens in generate_batch_with_images(generator, ids[at:at + batch_rows], sampling, eos, options)]
    tokenizer = generator.processor.tokenizer
    return [tokenizer.decode(t[:-1] if t and t[-1] in eos else t, skip_special_tokens=True) for t in new]


def generate_with_images(generator: ImageGenerator, prompt: str | list[dict], images: Sequence[Image.Image],
                         sampling: SamplingConfig = SamplingConfig(), options: ForwardOptions = ForwardOptions()
                         ) -> str:
    """`generate_texts_with_images` of one prompt about `images`: its text."""
    return generate_texts_with_images(generator, [prompt], [images], sampling, options)[0]
