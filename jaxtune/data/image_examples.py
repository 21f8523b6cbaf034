"""SFT records with images for a vision-language model (`ImageProcessor`: its family's processor): chat records
{"messages": [... {"type": "image"} parts ...], "images": [...]} and TRL's conversational prompt / completion lists
become `ImageExample`s, ids exactly as the model's processor writes them (the chat template's image marker replaced
by the processor's placeholder text: Gemma 3's boi, soft-token run, eoi), the loss on the assistant turns' text only
(never on an image's text), and the images' pixel arrays. An example cut by max_seq_len keeps only its images whose
placeholders it holds whole. Other records go through `formats.sft_examples`' path (no images). Preference pairs
with images (DPO): `image_preference_examples`; KTO's labelled completions with images: `image_labelled_examples`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxtune.data.chat_records import check_messages, check_tools
from jaxtune.data.formats import (
    DataStats,
    Example,
    LabelledExample,
    PreferenceExample,
    chat_spans,
    detect_format,
    eos_of,
    fit_example,
    record_chunks,
    render_chat,
    sft_chunk,
)
from jaxtune.data.images import image_base, image_parts, record_images
from jaxtune.data.sources import iter_records
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.family import ImageProcessor


@dataclass(frozen=True, eq=False)
class ImageExample(Example):
    """An `Example` and its images' pixel arrays, float32 [N, *shape] (N = 0: text alone), in the order of their
    placeholder runs in `ids` (one run an array)."""

    pixel_values: np.ndarray

    @property
    def images(self) -> int:
        return int(self.pixel_values.shape[0])


def expand_images(text: str, spans: list[tuple[int, int]], marker: str, expansions: list[str], where: str
                  ) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """(the text with its i-th `marker` replaced by expansions[i], the loss spans moved with it, the character
    ranges [start, end) of the expansions): the processor's string replacement, done on the rendered chat."""
    starts, at = [], text.find(marker)
    while at >= 0:
        starts.append(at)
        at = text.find(marker, at + len(marker))
    if len(starts) != len(expansions):
        raise JaxtuneError(f"{where}: the chat template wrote {len(starts)} image markers {marker!r} for "
                           f"{len(expansions)} images")
    pieces, ranges, cursor, shift = [], [], 0, 0
    shifts = []  # (original position, shift of positions after it)
    for start, expansion in zip(starts, expansions):
        pieces += [text[cursor:start], expansion]
        ranges.append((start + shift, start + shift + len(expansion)))
        shift += len(expansion) - len(marker)
        shifts.append((start, shift))
        cursor = start + len(marker)
    pieces.append(text[cursor:])

    def moved(p: int) -> int:
        return p + next((s for start, s in reversed(shifts) if start < p), 0)

    return "".join(pieces), [(moved(a), moved(b)) for a, b in spans], ranges


def image_example(messages: list[dict], images: list, processor: ImageProcessor, tokenizer: Tokenizer,
                  tools: list[dict] | None = None, where: str = "conversation") -> ImageExample:
    """One conversation with its images (PIL, one per image part, in order): ids [n] as the processor gives them
    (no special tokens beyond the template's), loss mask [n] 1 on the assistant turns' tokens outside any image's
    text, the pixel arrays."""
    text, spans = chat_spans(messages, tokenizer, tools, where)
    pixels, expansions = processor(images)
    text, spans, ranges = expand_images(text, spans, processor.marker, expansions, where)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    mask = [int(any(s < end and e > start for start, end in spans) and
                not any(s >= lo and e <= hi for lo, hi in ranges)) for s, e in encoding.offsets]
    ids = tuple(encoding.ids)
    found = sum(1 for run in _runs(ids, processor.image_token))
    if found != pixels.shape[0]:
        raise JaxtuneError(f"{where}: {found} image placeholder runs in the tokens for {pixels.shape[0]} pixel arrays "
                           "(does the tokenizer hold the image tokens as special tokens?)")
    return ImageExample(ids, tuple(mask), pixels)


def _runs(ids, token: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each run of `token` in ids."""
    is_token = np.asarray(ids) == token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_token.astype(np.int8), [0]])))
    return zip(edges[::2].tolist(), edges[1::2].tolist())


def fit_image_example(example: ImageExample, max_seq_len: int, stats: DataStats, image_token: int
                      ) -> ImageExample | None:
    """The max_seq_len policy (`formats.fit_example`) for an example with images: a cut that falls inside an
    image's placeholders moves back to where they start, and only the images held whole are kept."""
    ids, mask, cut = example.ids, example.loss_mask, len(example.ids)
    kept = example.images
    if cut > max_seq_len:
        runs = list(_runs(ids, image_token))
        cut = max_seq_len
        kept = sum(end <= cut for _, end in runs)
        cut = min([cut, *(start for start, _ in runs[kept:kept + 1])])
        stats.truncated += 1
    fitted = fit_example(Example(ids[:cut], mask[:cut]), max_seq_len, stats)
    return None if fitted is None else ImageExample(fitted.ids, fitted.loss_mask, example.pixel_values[:kept])


def record_messages(record: dict, where: str) -> list[dict] | None:
    """The conversation of a chat record, or of a conversational prompt / completion (lists of messages, TRL's
    vision format); None for the other formats (raw prompt / completion text, alpaca)."""
    fmt = detect_format(record)
    if fmt == "chat":
        return check_messages(where, record)
    if fmt == "prompt/completion" and isinstance(record.get("prompt"), list):
        completion = record.get("completion")
        if not isinstance(completion, list):
            raise JaxtuneError(f"{where}: a conversational prompt (a list of messages) needs its completion as a "
                               "list of messages too")
        return check_messages(where, {"messages": record["prompt"] + completion})
    return None


def image_sft_examples(path: str | Path, tokenizer: Tokenizer, processor: ImageProcessor, max_seq_len: int,
                       columns: Mapping[str, str] | None = None, stats: DataStats | None = None,
                       as_chat: bool = False) -> Iterator[Example]:
    """`formats.sft_examples` for a vision-language model: every record an `ImageExample` (records without images
    hold none), in file order; images read relative to the data file's directory, each failure one line naming
    FILE:LINE (`data.images`). Raises once the data is read if no example was kept."""
    stats = DataStats() if stats is None else stats
    eos = eos_of(tokenizer)
    base = image_base(path)
    empty: np.ndarray = np.zeros((0, *processor.pixel_shape), np.float32)
    for chunk in record_chunks(iter_records(path, columns)):
        for n, record in chunk:
            where = f"{path}:{n}"
            messages = record_messages(record, where)
            if messages is None:
                if "images" in record or "image" in record:
                    raise JaxtuneError(f"{where}: images need a chat record (\"messages\") or a conversational "
                                       "prompt / completion, whose {\"type\": \"image\"} parts place them")
                for text_only in sft_chunk(path, [(n, record)], tokenizer, max_seq_len, eos, stats, as_chat):
                    yield ImageExample(text_only.ids, text_only.loss_mask, empty)
                continue
            fmt = "chat" if "messages" in record else "prompt/completion"
            stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
            images = record_images(record, where, base, image_parts(messages))
            example = image_example(messages, images, processor, tokenizer, check_tools(where, record), where)
            fitted = fit_image_example(example, max_seq_len, stats, processor.image_token)
            if fitted is not None:
                yield fitted
    if not stats.examples:
        raise JaxtuneError(f"{path}: no example fits max_seq_len={max_seq_len} "
                           f"({stats.dropped_prompt_too_long} prompts too long)")


@dataclass(frozen=True, eq=False)
class ImagePreferenceExample(PreferenceExample):
    """A `PreferenceExample` whose prompt holds images: their pixel arrays float32 [N, *shape], in the order of the
    prompt's placeholder runs (both completions see them)."""

    pixel_values: np.ndarray

    @property
    def images(self) -> int:
        return int(self.pixel_values.shape[0])


def _turns(value, role: str, where: str, name: str) -> list[dict]:
    """A preference field as messages: TRL's conversational lists as given, text as one turn of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise JaxtuneError(f"{where}: preference field '{name}' must be a string or a list of messages")


def _prompt_and_completions(record: dict, names: tuple[str, ...], where: str, base: str | Path, tokenizer: Tokenizer,
                            processor: ImageProcessor) -> tuple[tuple[int, ...], np.ndarray, list[tuple[int, ...]]]:
    """(the prompt's ids, its images' pixel arrays, the ids of each completion field in `names`) of a vision record:
    the prompt rendered with the generation prompt and its image markers expanded (`image_example`'s ids), each
    completion the rest of the render of prompt + completion (its trailing whitespace left out, as SFT's loss spans
    leave it), as TRL applies the chat template."""
    prompt = check_messages(where, {"messages": [*_turns(record["prompt"], "user", where, "prompt"),
                                                 {"role": "assistant", "content": ""}]})[:-1]
    images = record_images(record, where, base, image_parts(prompt))
    text = render_chat(prompt, tokenizer, add_generation_prompt=True)
    completions = []
    for name in names:
        whole = render_chat(prompt + _turns(record[name], "assistant", where, name), tokenizer)
        if not whole.startswith(text):
            raise JaxtuneError(f"{where}: the chat template renders the prompt differently once the {name} "
                               "turn follows; its completion cannot be cut from the conversation")
        completions.append(tuple(tokenizer.encode(whole[len(text):].rstrip(), add_special_tokens=False)))
    pixels, expansions = processor(images)
    expanded, _, _ = expand_images(text, [], processor.marker, expansions, where)
    return tuple(tokenizer.encode(expanded, add_special_tokens=False)), pixels, completions


def image_preference_examples(path: str | Path, tokenizer: Tokenizer, processor: ImageProcessor, max_seq_len: int,
                              columns: Mapping[str, str] | None = None, stats: DataStats | None = None
                              ) -> Iterator[ImagePreferenceExample]:
    """TRL's vision preference records {"prompt", "chosen", "rejected", "images"} (the prompt's image parts take
    the images), prompt and completions as `_prompt_and_completions` writes them.
    A pair whose prompt fills max_seq_len is dropped; longer completions are cut to fit (counted in `stats`)."""
    stats = DataStats() if stats is None else stats
    base = image_base(path)
    for n, record in iter_records(path, columns):
        where = f"{path}:{n}"
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            raise JaxtuneError(f"{where}: preference record is missing field '{missing[0]}'")
        ids, pixels, (chosen, rejected) = _prompt_and_completions(record, ("chosen", "rejected"), where, base,
                                                                  tokenizer, processor)
        stats.formats["preference"] = stats.formats.get("preference", 0) + 1
        room = max_seq_len - len(ids)
        if room <= 0:
            stats.dropped_prompt_too_long += 1
            continue
        stats.truncated += len(chosen) > room or len(rejected) > room
        stats.examples += 1
        stats.loss_tokens += min(len(chosen), room) + min(len(rejected), room)
        yield ImagePreferenceExample(ids, chosen[:room], rejected[:room], pixels)
    if not stats.examples:
        raise JaxtuneError(f"{path}: no pair fits max_seq_len={max_seq_len} ({stats.dropped_prompt_too_long} "
                           "prompts too long)")


@dataclass(frozen=True, eq=False)
class ImageLabelledExample(LabelledExample):
    """A `LabelledExample` whose prompt holds images: their pixel arrays float32 [N, *shape], in the order of the
    prompt's placeholder runs."""

    pixel_values: np.ndarray

    @property
    def images(self) -> int:
        return int(self.pixel_values.shape[0])


def image_labelled_examples(path: str | Path, tokenizer: Tokenizer, processor: ImageProcessor, max_seq_len: int,
                            columns: Mapping[str, str] | None = None, stats: DataStats | None = None
                            ) -> Iterator[ImageLabelledExample]:
    """KTO's records with images: TRL's vision format {"prompt", "completion", "label": true | false, "images"}, and
    a pair {"prompt", "chosen", "rejected", "images"} as two (chosen desirable, rejected not: TRL's
    `unpair_preference_dataset`), prompt and completions as `_prompt_and_completions` writes them. A record whose
    prompt fills max_seq_len is dropped; a longer completion is cut to fit (counted in `stats`)."""
    stats = DataStats() if stats is None else stats
    base = image_base(path)
    for n, record in iter_records(path, columns):
        where = f"{path}:{n}"
        fmt = "preference" if "chosen" in record or "rejected" in record else "unpaired"
        names = ("chosen", "rejected") if fmt == "preference" else ("completion",)
        missing = [k for k in ("prompt", *names, *(("label",) if fmt == "unpaired" else ())) if k not in record]
        if missing:
            raise JaxtuneError(f"{where}: {fmt} record is missing field '{missing[0]}'")
        if fmt == "unpaired" and not isinstance(record["label"], bool):
            raise JaxtuneError(f"{where}: unpaired field 'label' must be true or false, got {record['label']!r}")
        ids, pixels, completions = _prompt_and_completions(record, names, where, base, tokenizer, processor)
        labels = (1, 0) if fmt == "preference" else (int(record["label"]),)
        stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
        room = max_seq_len - len(ids)
        if room <= 0:
            stats.dropped_prompt_too_long += len(labels)
            continue
        for completion, label in zip(completions, labels):
            stats.truncated += len(completion) > room
            stats.examples += 1
            stats.loss_tokens += min(len(completion), room)
            yield ImageLabelledExample(ids, completion[:room], (label,), pixels)
    if not stats.examples:
        raise JaxtuneError(f"{path}: no example fits max_seq_len={max_seq_len} ({stats.dropped_prompt_too_long} "
                           "prompts too long)")
