"""GRPO and RLOO prompts with images for a vision-language model (`ImagePrompt`), TRL 1.16 GRPOTrainer's format: a
conversational "prompt" (a list of messages) whose {"type": "image"} parts take the record's "images" (or "image"),
a prompt with no image parts getting them before the text of its first user turn whose content is a string, as TRL's
`prepare_multimodal_messages` places them. The prompt is rendered by the chat template with the generation prompt,
each image marker replaced by the processor's text (`image_examples.expand_images`), then tokenised; a text prompt (a
string, no images) is encoded as text GRPO encodes it. Images are read relative to the data file (`data.images`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxtune.data.chat_records import check_messages
from jaxtune.data.formats import render_chat
from jaxtune.data.image_examples import expand_images
from jaxtune.data.images import image_parts, image_references, record_images
from jaxtune.data.sources import iter_records
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.family import ImageProcessor


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """A prompt as the record gives it (messages, or text), the record's other fields (what rewards read), its
    ids as the processor writes them, its images' pixel arrays float32 [N, *shape] in placeholder order (N = 0)."""

    prompt: str | list[dict]
    fields: dict
    ids: tuple[int, ...]
    pixel_values: np.ndarray


def with_image_parts(messages: list[dict], count: int) -> list[dict]:
    """`messages` with `count` {"type": "image"} parts before the text of the first user turn whose content is a
    string, if they hold no image part (TRL's `prepare_multimodal_messages`); else as they are."""
    if not count or image_parts(messages):
        return messages
    out, placed = [], False
    for message in messages:
        if not placed and message.get("role") == "user" and isinstance(message.get("content"), str):
            parts = [*({"type": "image"} for _ in range(count)), {"type": "text", "text": message["content"]}]
            message, placed = {**message, "content": parts}, True
        out.append(message)
    return out


def image_prompt_examples(path: str | Path, tokenizer: Tokenizer, processor: ImageProcessor, max_images: int,
                          columns: Mapping[str, str] | None = None) -> list[ImagePrompt]:
    """The prompt records of a dataset for a vision-language policy, in file order (`ImagePrompt`); a record holding
    more pixel arrays than `max_images` ([data] max_images_per_row), images beside a text prompt, or a prompt that is
    neither text nor messages is one line naming FILE:LINE."""
    base = Path(path) if Path(path).is_dir() else Path(path).parent
    empty: np.ndarray = np.zeros((0, *processor.pixel_shape), np.float32)
    examples = []
    for n, record in iter_records(path, columns):
        where = f"{path}:{n}"
        if "prompt" not in record:
            raise JaxtuneError(f"{where}: prompt record is missing field 'prompt'")
        prompt, fields = record["prompt"], {k: v for k, v in record.items() if k != "prompt"}
        if isinstance(prompt, str):
            if image_references(record, where):
                raise JaxtuneError(f"{where}: images need a conversational prompt (a list of messages), as TRL's "
                                   "GRPOTrainer requires; the text prompt has nowhere to place them")
            examples.append(ImagePrompt(prompt, fields, tuple(tokenizer.encode(prompt)), empty))
            continue
        if not isinstance(prompt, list):
            raise JaxtuneError(f"{where}: field 'prompt' must be a string or a list of messages, got "
                               f"{type(prompt).__name__}")
        messages = check_messages(where, {"messages": [*prompt, {"role": "assistant", "content": ""}]})[:-1]
        messages = with_image_parts(messages, len(image_references(record, where)))
        images = record_images(record, where, base, image_parts(messages))
        pixels, expansions = processor(images)
        if pixels.shape[0] > max_images:
            raise JaxtuneError(f"{where}: the prompt's images make {pixels.shape[0]} pixel arrays; [data] "
                               f"max_images_per_row = {max_images} must be at least that")
        text, _, _ = expand_images(render_chat(messages, tokenizer, add_generation_prompt=True), [], processor.marker,
                                   expansions, where)
        examples.append(ImagePrompt(messages, fields, tuple(tokenizer.encode(text, add_special_tokens=False)),
                                    pixels))
    return examples
