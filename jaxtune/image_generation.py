"""Generation with images (a vision-language model; its family's `ImageProcessor` and `prefill`): one prompt, its
images placed by the chat template's image markers expanded as the processor does, prefilled into a KV cache by the
family (the images' tokens, Gemma 3's bidirectional spans, Qwen2.5-VL's M-RoPE positions), then decoded a token at a
time (greedy, or sampled as `generation` samples). `load_image_generator` reads what it needs from a model directory
(and a PEFT adapter)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.formats import render_chat
from jaxtune.data.image_examples import expand_images
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import sample
from jaxtune.models.kv_cache import decode_step, prefill
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
    tokenizer = processor.tokenizer
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": prompt}]}]
    text = render_chat(prompt, tokenizer, add_generation_prompt=True)
    pixels, expansions = processor(images)
    text, _, _ = expand_images(text, [], processor.marker, expansions, "prompt")
    return tokenizer.encode(text, add_special_tokens=False), pixels


@partial(jax.jit, static_argnames=("cfg", "processor", "cache_size", "method", "options"))
def _prefill(params, vision_params, tokens_1xT, pixels, *, cfg, processor, cache_size, method, options):
    if pixels.shape[0] == 0:
        return prefill(params, tokens_1xT, cfg, cache_size=cache_size, method=method, options=options)
    return processor.family.prefill(params, vision_params, tokens_1xT, pixels, cfg, processor.config,
                                    cache_size=cache_size, method=method, options=options)


def generate_ids_with_images(generator: ImageGenerator, ids: Sequence[int], pixels: np.ndarray,
                             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (),
                             options: ForwardOptions = ForwardOptions()) -> list[int]:
    """Up to `sampling.max_new_tokens` tokens after the prompt `ids` with its pixel arrays [N, ...] (N x the
    family's tokens an image in placeholders), stopping after one of `eos_ids` (kept)."""
    g, n = generator, sampling.max_new_tokens
    tokens = jnp.asarray([list(ids)], jnp.int32)
    if pixels.shape[0] == 0:
        pixels = np.zeros((0, *g.processor.pixel_shape), np.float32)
    logits, cache = _prefill(g.params, g.vision_params, tokens, jnp.asarray(pixels), cfg=g.cfg,
                             processor=g.processor, cache_size=len(ids) + n, method=g.method, options=options)
    step = jax.jit(decode_step, static_argnames=("cfg", "method", "options"), donate_argnames=("cache",))
    key = jax.random.key(sampling.seed)
    out: list[int] = []
    for _ in range(n):
        if sampling.temperature == 0:
            token = int(jnp.argmax(logits[0]))
        else:
            key, draw = jax.random.split(key)
            token = int(sample(logits, draw, jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
                               jnp.float32(sampling.top_p))[0])
        out.append(token)
        if token in eos_ids or len(out) == n:
            break
        logits, cache = step(g.params, jnp.asarray([token], jnp.int32), cache, cfg=g.cfg, method=g.method,
                             options=options)
    return out


def generate_with_images(generator: ImageGenerator, prompt: str | list[dict], images: Sequence[Image.Image],
                         sampling: SamplingConfig = SamplingConfig(), options: ForwardOptions = ForwardOptions()
                         ) -> str:
    """The text the model answers `prompt` (text, or a conversation with image parts) about `images` with, up to
    its EOS (the model's or the tokenizer's) or `sampling.max_new_tokens`."""
    ids, pixels = prompt_ids(generator.processor, prompt, images)
    tokenizer = generator.processor.tokenizer
    eos = {*generator.cfg.eos_token_id, *([tokenizer.eos_id] if tokenizer.eos_id is not None else [])}
    new = generate_ids_with_images(generator, ids, pixels, sampling, sorted(eos), options)
    return tokenizer.decode(new[:-1] if new and new[-1] in eos else new, skip_special_tokens=True)
