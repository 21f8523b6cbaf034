"""Instruction data, a record an example (`data.sources`: JSONL, Parquet, ...), turned into token ids and a loss mask.

  alpaca             {"instruction", "input" (optional), "output"}: the Stanford Alpaca prompt, output as completion
  prompt/completion  {"prompt", "completion"}: encode(prompt) with special tokens + encode(completion) + [EOS]
  chat               {"messages": [{"role", "content"}, ...], "tools"?}: by the model's chat template (`render_chat`)
  preference         {"prompt", "chosen", "rejected"}: `preference_examples`, for DPO and reward models
  unpaired           {"prompt", "completion", "label": true/false}: KTO's `labelled_examples` (pairs are split there)
  prompts            {"prompt", ...any other fields}: GRPO's prompts, `load_prompt_examples`
`sft_examples` reads the first three, mixed; the loss covers completions and EOS, or the assistant turns. A prompt
that fills `max_seq_len` is dropped, a longer example cut (`DataStats`)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxtune.data.chat_records import check_messages, check_tools, content_text
from jaxtune.data.images import image_parts
from jaxtune.data.sources import iter_records, json_type
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError

# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# For models that ship no chat template (Zephyr's layout): every turn is "<|role|>\n" + content, closed by EOS,
# so a model trained on it stops at EOS. The role markers are plain text for any tokenizer.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Example:
    """Token ids [n] and a loss mask [n]: 1 where the token is a prediction target (completion, EOS), else 0."""

    ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __post_init__(self):
        if len(self.ids) != len(self.loss_mask):
            raise ValueError(f"{len(self.ids)} ids but {len(self.loss_mask)} loss mask entries")


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt's ids (with special tokens) and two completions, each completion ids + [EOS]."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


@dataclass(frozen=True)
class LabelledExample:
    """An unpaired completion (KTO): a prompt's ids (with special tokens), the completion ids + [EOS], and its label,
    (1,) desirable or (0,) undesirable (a one-item field, as `data.store` keeps fields)."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    label: tuple[int]


@dataclass(frozen=True)
class PromptExample:
    """A GRPO prompt and the record's other fields (e.g. an "answer" a verifiable reward checks)."""

    prompt: str
    fields: dict


@dataclass
class DataStats:
    """What loading did. `formats`: records per format, before the max_seq_len policy; `loss_tokens`: targets
    kept (sum of loss_mask[1:]; for preferences, chosen + rejected tokens)."""

    examples: int = 0
    dropped_prompt_too_long: int = 0
    truncated: int = 0
    dropped_empty: int = 0  # nothing left to predict (e.g. a lone token)
    loss_tokens: int = 0
    formats: dict[str, int] = field(default_factory=dict)

    def summary(self, max_seq_len: int) -> str:
        """One line for logs: "120 examples (alpaca 120), 2 dropped: prompt >= max_seq_len=512, 5 truncated, ..."."""
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        return (f"{self.examples} examples ({kinds}), {self.dropped_prompt_too_long} dropped: prompt >= "
                f"max_seq_len={max_seq_len}, {self.truncated} truncated, {self.loss_tokens} loss tokens")


def _text(where: str, record: dict, fmt: str, name: str, optional: bool = False) -> str:
    """record[name], which must be a string (optional: absent or null reads as "")."""
    value = record.get(name)
    if value is None and optional:
        return ""
    if name not in record:
        raise JaxtuneError(f"{where}: {fmt} record is missing field '{name}'")
    if not isinstance(value, str):
        raise JaxtuneError(f"{where}: {fmt} field '{name}' must be a string, got {json_type(value)}")
    return value


def detect_format(record: dict) -> str | None:
    """"chat", "alpaca", "preference", "prompt/completion" or None, from the record's keys."""
    if "messages" in record:
        return "chat"
    if "instruction" in record:
        return "alpaca"
    if "chosen" in record or "rejected" in record:
        return "preference"
    if "prompt" in record or "completion" in record:
        return "prompt/completion"
    return None


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The Stanford Alpaca prompt, with the input section only when `input` is non-empty."""
    if input:
        return ALPACA_PROMPT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


# --- chat templates -------------------------------------------------------------------------------------------

class _Generation(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` blocks and renders their body as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja's own escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """A template compiled in the sandboxed environment transformers uses (same options, filters and globals)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise JaxtuneError(f"chat template is not valid Jinja: line {e.lineno}: {e.message}") from None


def render_chat(messages: list[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> str:
    """The conversation as text, by the tokenizer's chat template (else `DEFAULT_CHAT_TEMPLATE`).

    Like `apply_chat_template(..., tools=tools, tokenize=False)`: variables `messages` (null-valued keys dropped),
    `tools` (JSON schemas, or None), `add_generation_prompt` and the special tokens the tokenizer has (`bos_token`,
    `eos_token`, `pad_token`). Raises jinja2.TemplateError when the template does (e.g. `raise_exception`).
    """
    template = compile_chat_template(tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE)
    special = {name: tokenizer.backend.id_to_token(i) for name, i in
               (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id), ("pad_token", tokenizer.pad_id))
               if i is not None}
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **special)


def _chat_text(where: str, messages: list[dict], tokenizer: Tokenizer, tools: list[dict] | None = None
               ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) the loss covers.

    Assistant message i is trained from the end of the render of messages[:i] with the generation prompt to the end
    of the render of messages[:i+1], trailing whitespace excluded: what the model writes after the prompt (a
    reasoning block the template adds, the content) and what closes it (EOS / end-of-turn token). Templates that
    render a turn differently once later turns follow break that prefix property: Qwen3 drops the reasoning block
    (`<think>...</think>` in the content) of earlier turns, Phi-3 ends only the last turn with EOS. Then the turn's
    content (without a dropped reasoning block) is found in the whole render after the previous message's, and
    trained with as much of the closing text its own render puts after it as the whole render has there. A turn that
    calls tools is found as its own render (what follows the generation prompt), less a reasoning block the
    template adds only to the last turn (Qwen3's empty `<think>` block), or, where the generation prompt is not how
    the history reads (Nemotron 3's `<think>\n` against `<think></think>`), from where the two part. `tools` go to
    the template.
    """
    try:
        text = render_chat(messages, tokenizer, tools=tools)
        spans, cursor = [], 0  # cursor: where the previous message's content ends in `text`
        for i, m in enumerate(messages):
            body = content_text(m)
            if m["role"] != "assistant":
                found = text.find(body, cursor) if body else -1
                cursor = found + len(body) if found >= 0 else cursor
                continue
            before = render_chat(messages[:i], tokenizer, add_generation_prompt=True, tools=tools)
            through = render_chat(messages[: i + 1], tokenizer, tools=tools).rstrip()
            start = len(before) if text.startswith(before) and len(before) >= cursor else None
            if start is None and m.get("tool_calls") and text.startswith(through):
                start = len(os.path.commonprefix([before, text]))  # where the generation prompt departs from it
                start = start if start >= cursor else None
            if start is not None and text.startswith(through) and start <= len(through):
                end = len(through)
            elif start is not None and m.get("tool_calls") and (own := _own_turn(before, through, text, start)):
                end = start + own
            else:
                if "</think>" in body and body not in text:  # a reasoning block the template drops from history
                    body = body.rsplit("</think>", 1)[-1].strip()
                found = text.find(body, cursor if start is None else start) if body else -1
                if found < 0:
                    raise JaxtuneError(f"{where}: the chat template renders assistant message {i} neither after the "
                                       "conversation before it nor with its content as written, so the loss mask "
                                       "cannot be found")
                # what closes the turn in its own render ("<|im_end|>"), or as much of it, up to a whitespace, as
                # the whole render has there (Phi-3 puts EOS after the last turn only)
                closing = through[through.rfind(body) + len(body):]
                cuts = [closing] + [closing[:m.start()] for m in reversed(list(re.finditer(r"\s+", closing)))]
                end = found + len(body)
                end += next((len(cut) for cut in cuts if text.startswith(cut, end)), 0)
                start = found if start is None else start
            spans.append((start, end))
            cursor = end
    except (jinja2.TemplateError, TypeError) as e:  # a template's own error, or one it hits (e.g. str + int)
        raise JaxtuneError(f"{where}: chat template: {e}") from None
    return text, spans


def _own_turn(before: str, through: str, text: str, start: int) -> int:
    """The length of the turn's own render (`through` after `before`) where the whole render has it at `start`, as
    written or less a leading reasoning block; 0 when it has neither."""
    own = through[len(before):] if through.startswith(before) else ""
    for candidate in (own, re.sub(r"^\s*<think>.*?</think>\s*", "", own, count=1, flags=re.DOTALL)):
        if candidate and text.startswith(candidate, start):
            return len(candidate)
    return 0


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (a token that starts in the prompt and ends in the
    response is trained: the model must produce it)."""
    return [int(any(s < end and e > start for start, end in spans)) for s, e in offsets]


def chat_spans(messages: list[dict], tokenizer: Tokenizer, tools: list[dict] | None = None,
               where: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered by its chat template (with `tools`) and the character spans [start, end) of its
    assistant turns: each turn's content, tool calls and the token that ends it (`_chat_text`)."""
    return _chat_text(where, messages, tokenizer, tools)


def chat_example(messages: list[dict], tokenizer: Tokenizer, tools: list[dict] | None = None,
                 where: str = "conversation") -> Example:
    """One conversation's token ids [n] and loss mask [n]: 1 on the tokens of the assistant turns' spans
    (`chat_spans`), 0 on system, user and tool turns. What a chat record trains on, before the max_seq_len policy."""
    text, spans = chat_spans(messages, tokenizer, tools, where)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    return Example(tuple(encoding.ids), tuple(_span_mask(encoding.offsets, spans)))


# --- loading --------------------------------------------------------------------------------------------------

def eos_of(tokenizer: Tokenizer) -> int:
    if tokenizer.eos_id is None:
        raise JaxtuneError("the tokenizer has no EOS token; set eos_token in tokenizer_config.json")
    return tokenizer.eos_id


def _check_max_seq_len(max_seq_len: int) -> None:
    if max_seq_len < 2:
        raise JaxtuneError(f"max_seq_len={max_seq_len} must be at least 2")


def fit_example(example: Example, max_seq_len: int, stats: DataStats) -> Example | None:
    """The max_seq_len policy: drop when the prompt fills it, else cut the tail; counted in `stats`."""
    ids, mask = example.ids, example.loss_mask
    first = mask.index(1) if 1 in mask else len(mask)
    if first >= max_seq_len:
        stats.dropped_prompt_too_long += 1
        return None
    if len(ids) > max_seq_len:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        stats.truncated += 1
    trained = sum(mask[1:])  # the first token is never a target: nothing precedes it
    if trained == 0:
        stats.dropped_empty += 1
        return None
    stats.examples += 1
    stats.loss_tokens += trained
    return Example(ids, mask)


def _encode_batch(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool):
    """Encodings with `.ids` (no offsets: the fast path where the tokenizers library has one)."""
    encode = getattr(tokenizer.backend, "encode_batch_fast", tokenizer.backend.encode_batch)
    return encode(texts, add_special_tokens=add_special_tokens)


def record_chunks(items, size: int = 1024):
    """Lists of up to `size` items of an iterable, as it is consumed."""
    items = iter(items)
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _no_example(path, max_seq_len: int, stats: DataStats) -> JaxtuneError:
    return JaxtuneError(f"{path}: no example fits max_seq_len={max_seq_len} "
                        f"({stats.dropped_prompt_too_long} prompts too long)")


def sft_examples(path: str | Path, tokenizer: Tokenizer, max_seq_len: int, columns: Mapping[str, str] | None = None,
                 stats: DataStats | None = None, as_chat: bool = False) -> Iterator[Example]:
    """Examples of an alpaca / prompt-completion / chat dataset (`iter_records`: JSONL, Parquet, Arrow, ...), in
    file order, after the max_seq_len policy, tokenised a chunk of records at a time as they are read, so a dataset
    larger than memory streams through (`data.store`); `columns` renames the dataset's columns to ours; `stats`
    counts what loading did. as_chat: alpaca and prompt/completion records too become a user turn (the prompt; an
    alpaca instruction and its input) and an assistant turn (the completion) of the model's chat template, the loss
    on the assistant turn, as a chat record would. Raises once the data is read if no example was kept."""
    _check_max_seq_len(max_seq_len)
    eos = eos_of(tokenizer)
    stats = DataStats() if stats is None else stats
    for chunk in record_chunks(iter_records(path, columns)):
        yield from sft_chunk(path, chunk, tokenizer, max_seq_len, eos, stats, as_chat)
    if not stats.examples:
        raise _no_example(path, max_seq_len, stats)


def sft_chat_examples(path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                      columns: Mapping[str, str] | None = None, stats: DataStats | None = None) -> Iterator[Example]:
    """`sft_examples(..., as_chat=True)`: what `[data] apply_chat_template = true` trains on."""
    return sft_examples(path, tokenizer, max_seq_len, columns, stats, as_chat=True)


def _as_turns(prompt: str, completion: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def sft_chunk(path, records: list[tuple[int, dict]], tokenizer: Tokenizer, max_seq_len: int, eos: int,
               stats: DataStats, as_chat: bool = False) -> list[Example]:
    pairs: list[tuple[int, str, str]] = []  # (record index, prompt, completion)
    chats: list[tuple[int, str, list[tuple[int, int]]]] = []  # (record index, text, trained spans)
    for k, (n, record) in enumerate(records):
        where, fmt = f"{path}:{n}", detect_format(record)
        if fmt == "alpaca" and as_chat:
            instruction, extra = _text(where, record, fmt, "instruction"), _text(where, record, fmt, "input", True)
            user = f"{instruction}\n\n{extra}" if extra else instruction
            turns = _as_turns(user, _text(where, record, fmt, "output"))
            chats.append((k, *_chat_text(where, turns, tokenizer)))
        elif fmt == "alpaca":
            prompt = alpaca_prompt(_text(where, record, fmt, "instruction"), _text(where, record, fmt, "input", True))
            pairs.append((k, prompt, _text(where, record, fmt, "output")))
        elif fmt == "prompt/completion" and as_chat:
            turns = _as_turns(_text(where, record, fmt, "prompt"), _text(where, record, fmt, "completion"))
            chats.append((k, *_chat_text(where, turns, tokenizer)))
        elif fmt == "prompt/completion":
            pairs.append((k, _text(where, record, fmt, "prompt"), _text(where, record, fmt, "completion")))
        elif fmt == "chat":
            messages, tools = check_messages(where, record), check_tools(where, record)
            if image_parts(messages) or "images" in record or "image" in record:
                raise JaxtuneError(f"{where}: a record with images, but the model reads no images (a text model)")
            chats.append((k, *_chat_text(where, messages, tokenizer, tools)))
        elif fmt == "preference":
            raise JaxtuneError(f"{where}: a preference record {{prompt, chosen, rejected}} in supervised data; "
                               "train it with a preference objective (load_preference_examples)")
        else:
            raise JaxtuneError(f"{where}: unknown record with keys {sorted(record)}; expected alpaca "
                               "{instruction, input, output}, {prompt, completion} or chat {messages}")
        stats.formats[fmt] = stats.formats.get(fmt, 0) + 1

    built: list[Example | None] = [None] * len(records)
    if pairs:  # encode_batch runs in parallel
        prompts = _encode_batch(tokenizer, [p for _, p, _ in pairs], add_special_tokens=True)
        completions = _encode_batch(tokenizer, [c for _, _, c in pairs], add_special_tokens=False)
        for (k, _, _), p, c in zip(pairs, prompts, completions):
            built[k] = Example((*p.ids, *c.ids, eos), (0,) * len(p.ids) + (1,) * (len(c.ids) + 1))
    if chats:  # the full encode: the loss mask needs character offsets
        encodings = tokenizer.backend.encode_batch([t for _, t, _ in chats], add_special_tokens=False)
        for (k, _, spans), enc in zip(chats, encodings):
            built[k] = Example(tuple(enc.ids), tuple(_span_mask(enc.offsets, spans)))
    return [ex for ex in (fit_example(b, max_seq_len, stats) for b in built if b is not None) if ex is not None]


def load_sft_examples(path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                      columns: Mapping[str, str] | None = None, as_chat: bool = False
                      ) -> tuple[list[Example], DataStats]:
    """Every example of `sft_examples`, in a list, and what loading did."""
    stats = DataStats()
    return list(sft_examples(path, tokenizer, max_seq_len, columns, stats, as_chat)), stats


def preference_examples(path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                        columns: Mapping[str, str] | None = None, stats: DataStats | None = None
                        ) -> Iterator[PreferenceExample]:
    """Preference pairs {prompt, chosen, rejected}, a chunk of records at a time as they are read;
    len(prompt) + len(completion) <= max_seq_len for each side. Raises once the data is read if none was kept."""
    _check_max_seq_len(max_seq_len)
    eos = eos_of(tokenizer)
    stats = DataStats() if stats is None else stats
    for chunk in record_chunks(iter_records(path, columns)):
        texts = [tuple(_text(f"{path}:{n}", record, "preference", name) for name in ("prompt", "chosen", "rejected"))
                 for n, record in chunk]
        stats.formats["preference"] = stats.formats.get("preference", 0) + len(texts)
        prompts = _encode_batch(tokenizer, [t[0] for t in texts], add_special_tokens=True)
        chosen = _encode_batch(tokenizer, [t[1] for t in texts], add_special_tokens=False)
        rejected = _encode_batch(tokenizer, [t[2] for t in texts], add_special_tokens=False)
        for p, c, r in zip(prompts, chosen, rejected):
            room = max_seq_len - len(p.ids)
            if room <= 0:
                stats.dropped_prompt_too_long += 1
                continue
            c_ids, r_ids = (*c.ids, eos), (*r.ids, eos)
            if len(c_ids) > room or len(r_ids) > room:
                stats.truncated += 1
            stats.examples += 1
            stats.loss_tokens += min(len(c_ids), room) + min(len(r_ids), room)
            yield PreferenceExample(tuple(p.ids), c_ids[:room], r_ids[:room])
    if not stats.examples:
        raise _no_example(path, max_seq_len, stats)


def load_preference_examples(path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                             columns: Mapping[str, str] | None = None) -> tuple[list[PreferenceExample], DataStats]:
    """Every pair of `preference_examples`, in a list, and what loading did."""
    stats = DataStats()
    return list(preference_examples(path, tokenizer, max_seq_len, columns, stats)), stats


def labelled_examples(path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                      columns: Mapping[str, str] | None = None, stats: DataStats | None = None
                      ) -> Iterator[LabelledExample]:
    """KTO's unpaired completions {prompt, completion, label: true | false} (TRL's unpaired preference format); a
    pair {prompt, chosen, rejected} gives two, chosen desirable and rejected not (TRL's `unpair_preference_dataset`).
    A chunk of records at a time, cut and dropped as `preference_examples`; raises once read if none was kept."""
    _check_max_seq_len(max_seq_len)
    eos = eos_of(tokenizer)
    stats = DataStats() if stats is None else stats
    for chunk in record_chunks(iter_records(path, columns)):
        items: list[tuple[str, str, int]] = []  # (prompt, completion, label)
        for n, record in chunk:
            where = f"{path}:{n}"
            if detect_format(record) == "preference":
                prompt = _text(where, record, "preference", "prompt")
                items += [(prompt, _text(where, record, "preference", "chosen"), 1),
                          (prompt, _text(where, record, "preference", "rejected"), 0)]
                fmt = "preference"
            else:
                texts = [_text(where, record, "unpaired", name) for name in ("prompt", "completion")]
                if "label" not in record:
                    raise JaxtuneError(f"{where}: unpaired record is missing field 'label' (true: a desirable "
                                       "completion, false: an undesirable one)")
                if not isinstance(record["label"], bool):
                    raise JaxtuneError(f"{where}: unpaired field 'label' must be true or false, got "
                                       f"{json_type(record['label'])}")
                items.append((texts[0], texts[1], int(record["label"])))
                fmt = "unpaired"
            stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
        prompts = _encode_batch(tokenizer, [p for p, _, _ in items], add_special_tokens=True)
        completions = _encode_batch(tokenizer, [c for _, c, _ in items], add_special_tokens=False)
        for p, c, (_, _, label) in zip(prompts, completions, items):
            room = max_seq_len - len(p.ids)
            if room <= 0:
                stats.dropped_prompt_too_long += 1
                continue
            ids = (*c.ids, eos)
            stats.truncated += len(ids) > room
            stats.examples += 1
            stats.loss_tokens += min(len(ids), room)
            yield LabelledExample(tuple(p.ids), ids[:room], (label,))
    if not stats.examples:
        raise _no_example(path, max_seq_len, stats)


def load_prompt_examples(path: str | Path, columns: Mapping[str, str] | None = None) -> list[PromptExample]:
    """The records of a prompts dataset, in file order: a string "prompt" each, other fields kept as they are."""
    examples = []
    for n, record in iter_records(path, columns):
        prompt = _text(f"{path}:{n}", record, "prompt", "prompt")
        examples.append(PromptExample(prompt, {k: v for k, v in record.items() if k != "prompt"}))
    return examples


def is_preference_file(path: str | Path, columns: Mapping[str, str] | None = None) -> bool:
    """Whether a dataset's first record is a preference pair (has "chosen" or "rejected")."""
    return detect_format(next(iter_records(path, columns))[1]) == "preference"


def train_eval_split(examples: Sequence, eval_fraction: float, seed: int) -> tuple[Sequence, Sequence]:
    """A deterministic split: round(eval_fraction * n) examples (at least 1 when the fraction is > 0) drawn by
    `seed` go to eval; both parts keep file order. A list gives lists; a store (`data.store.TokenStore`) gives two
    stores over its files, reading no tokens."""
    if not 0.0 <= eval_fraction < 1.0:
        raise JaxtuneError(f"eval_fraction={eval_fraction} must be in [0, 1)")
    n = len(examples)
    n_eval = 0 if eval_fraction == 0 else max(1, round(eval_fraction * n))
    if n_eval >= n and n_eval > 0:
        raise JaxtuneError(f"eval_fraction={eval_fraction} of {n} examples leaves none to train on")
    is_eval: np.ndarray = np.zeros(n, bool)
    is_eval[np.random.default_rng(seed).permutation(n)[:n_eval]] = True
    if hasattr(examples, "take"):
        return examples.take(np.flatnonzero(~is_eval)), examples.take(np.flatnonzero(is_eval))
    return [e for e, v in zip(examples, is_eval) if not v], [e for e, v in zip(examples, is_eval) if v]
