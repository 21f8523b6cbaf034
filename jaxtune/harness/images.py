"""lm-eval's requests with images (a multimodal task's `visual` argument) for a vision-language model, by
`hf-multimodal`'s conventions: `request_images` reads them (PIL images, or paths / bytes as `data.images` reads them;
each failure one line naming the task, doc and image), `marked_text` puts the family's image marker where lm-eval
writes `<image>` and `image_chat` splits a chat turn there into image parts, and `score_with_images` gives
(log p, greedy) of continuations after contexts with their images, right-padded rows in one jitted forward each."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jaxtune.config import ForwardOptions
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.data.images import read_image
from jaxtune.errors import JaxtuneError
from jaxtune.image_generation import ImageGenerator

PLACEHOLDER = "<image>"  # lm-eval's DEFAULT_IMAGE_PLACEHOLDER, which its multimodal tasks write


def request_images(request) -> list[Image.Image]:
    """The images of an lm-eval `Instance` (its last argument's `visual`: one image or a list), each decoded in full:
    a PIL image as the task's dataset gives it, or a path (from the working directory), bytes or `{"bytes", "path"}`."""
    visual = request.args[-1].get("visual") if isinstance(request.args[-1], dict) else None
    images = [] if visual is None else visual if isinstance(visual, (list, tuple)) else [visual]
    where = f"task {request.task_name}, doc {request.doc_id}"
    out = []
    for k, image in enumerate(images):
        what = f"{where}, image {k}"
        if not isinstance(image, Image.Image):
            out.append(read_image(image, Path.cwd(), what))
            continue
        try:
            image.load()  # a truncated file decodes lazily: fail here, naming it
        except (OSError, ValueError, SyntaxError) as e:
            source = getattr(image, "filename", "") or type(image).__name__
            raise JaxtuneError(f"{what} ({source}): not an image Pillow can read ({type(e).__name__}: {e})") from None
        out.append(image)
    return out


def marked_text(text: str, marker: str, images: int, where: str) -> str:
    """The text with lm-eval's `<image>` placeholders as the family's marker (hf-multimodal puts the model's image
    token there, or `image_string`); one line when they are not one per image."""
    if images and PLACEHOLDER not in text and text.count(marker) == images:
        return text  # a chat template already wrote the markers
    if text.count(PLACEHOLDER) != images:
        raise JaxtuneError(f"{where}: {text.count(PLACEHOLDER)} {PLACEHOLDER} placeholders in the context for "
                           f"{images} images")
    return text.replace(PLACEHOLDER, marker)


def image_chat(messages: list[dict]) -> list[dict]:
    """The chat with each turn's text split at `<image>` into text and image parts, as hf-multimodal's (interleaved)
    chat template input."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and PLACEHOLDER in content:
            parts: list[dict] = []
            for i, piece in enumerate(content.split(PLACEHOLDER)):
                parts += ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
            message = {**message, "content": parts}
        out.append(message)
    return out


@partial(jax.jit, static_argnames=("cfg", "processor", "method", "options"))
def _token_logps(params, vision_params, tokens_BxT, pixels_BxMx, *, cfg, processor, method, options):
    """(log p of each next token [B, T-1], whether it is the greedy one [B, T-1])."""
    logits_BxTxV = processor.family.forward(params, vision_params, tokens_BxT,
                                            pixels_BxMx if pixels_BxMx.shape[1] else None, cfg, processor.config,
                                            method=method, options=options)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV[:, :-1].astype(jnp.float32), axis=-1)
    target_BxT = tokens_BxT[:, 1:]
    picked_BxT = jnp.take_along_axis(logp_BxTxV, target_BxT[..., None], axis=-1)[..., 0]
    return picked_BxT, jnp.argmax(logp_BxTxV, axis=-1) == target_BxT


def score_with_images(generator: ImageGenerator, requests: Sequence[tuple[Sequence[int], Sequence[int], np.ndarray]],
                      options: ForwardOptions = ForwardOptions(), batch_rows: int = 16) -> list[tuple[float, bool]]:
    """(log p of the continuation, whether each of its tokens is the greedy one) per (context ids, continuation ids,
    the context's pixel arrays [N, *pixel_shape]): rows right-padded to power-of-two buckets (a causal model's
    padding after a row changes nothing before it), each row's images [M, *pixel_shape]."""
    g, shape = generator, generator.processor.pixel_shape
    results: list[tuple[float, bool]] = []
    for at in range(0, len(requests), batch_rows):
        batch = requests[at:at + batch_rows]
        B = bucket(len(batch))
        T = bucket(max(len(c) + len(n) for c, n, _ in batch), MIN_BUCKET)
        most = max(len(p) for _, _, p in batch)
        tokens_BxT: np.ndarray = np.zeros((B, T), np.int32)
        pixels_BxMx: np.ndarray = np.zeros((B, bucket(most) if most else 0, *shape), np.float32)
        for row, (context, continuation, pixels) in enumerate(batch):
            ids = [*context, *continuation]
            tokens_BxT[row, :len(ids)] = ids
            pixels_BxMx[row, :len(pixels)] = pixels
        logp, greedy = jax.device_get(_token_logps(g.params, g.vision_params, tokens_BxT, pixels_BxMx, cfg=g.cfg,
                                                   processor=g.processor, method=g.method, options=options))
        for row, (context, continuation, _) in enumerate(batch):
            span = slice(len(context) - 1, len(context) + len(continuation) - 1)
            results.append((float(np.sum(logp[row, span], dtype=np.float64)), bool(np.all(greedy[row, span]))))
    return results
