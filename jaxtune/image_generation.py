"""Generation with images (a vision-language model; its family's `ImageProcessor`): prompts, each with its own images
placed by the chat template's image markers expanded as the processor does, decoded together by
`image_decoding.decode_with_images` (left-padded to power-of-two buckets, images a row bucketed too, prefilled by the
family, decoded by `generation`'s loop; greedy, or sampled as `generation` samples). `load_image_generator` reads what
it needs from a model directory (and a PEFT adapter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import bucket
from jaxtune.data.formats import render_chat
from jaxtune.data.image_examples import expand_images
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.image_decoding import PromptImages, decode_with_images
from jaxtune.models.vision.families import image_processor
from jaxtune.models.vision.family import ImageProcessor, ImageSide
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


def prompt_images(processor: ImageProcessor, pixel_arrays: Sequence[np.ndarray]) -> PromptImages:
    """The `PromptImages` of prompts with pixel arrays `pixel_arrays` (each [k, *pixel_shape]), M (images a row) the
    power-of-two bucket of the most any has (0 when none has one), so that batches of similar sizes share one
    program."""
    most = max((len(own) for own in pixel_arrays), default=0)
    side = ImageSide(processor.family, processor.config, bucket(most) if most else 0, processor.pixel_shape)
    return PromptImages.of(side, pixel_arrays)


def generate_batch_with_images(generator: ImageGenerator, prompts: Sequence[tuple[Sequence[int], np.ndarray]],
                               sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (),
                               options: ForwardOptions = ForwardOptions(),
                               stop_when: Callable[[int, list[int]], bool] | None = None, chunk_steps: int = 16
                               ) -> list[list[int]]:
    """Each prompt's new tokens, decoded together: up to `sampling.max_new_tokens`, ending with the first of
    `eos_ids` (kept). prompts: (token ids, pixel arrays [N, *pixel_shape]) as `prompt_ids` gives them (N x the
    family's tokens an image in placeholders). Greedy, a prompt's tokens are those it gets alone.
    stop_when(prompt index, its new tokens so far), as `generation.generate`'s: asked on the host every
    `chunk_steps` steps for each row still running; True ends that row (its tokens run to the end of the chunk); a
    `StopStrings` also cuts the tokens where the row's text first held one of its strings. A prompt that with
    `max_new_tokens` would pass the model's context is one error line."""
    g = generator
    images = prompt_images(g.processor, [pixels for _, pixels in prompts])
    return decode_with_images(g.params, g.vision_params, g.cfg, [ids for ids, _ in prompts], images, sampling,
                              eos_ids=eos_ids, method=g.method, options=options, include_stop=True,
                              stop_when=stop_when, chunk_steps=chunk_steps)


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
