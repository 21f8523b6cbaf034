"""`jaxtune generate --data`: a JSONL file of requests in, one completion each out, in input order.

    records = generate_file("model-dir", "prompts.jsonl", adapters={"a": "run-a/adapter", "b": "run-b/adapter"})

A request is {"prompt": text} or {"messages": [{"role", "content"}, ...]} (rendered by the chat template), with
optional "adapter" (a name of `adapters`; absent: the base model, or the one `adapter`), "stop" (strings that end
its completion) and "max_new_tokens". Requests that share max_new_tokens run as one batch, their adapters mixed
(`methods/adapter_rows.py`); each answer is {"prompt" or "messages", "adapter", "completion"}.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxtune.config import ModelConfig, SamplingConfig
from jaxtune.data.sources import read_records
from jaxtune.data.tokenizer import Tokenizer, load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate_text
from jaxtune.spine.model import load_adapters, load_model_with_adapter


@dataclasses.dataclass(frozen=True)
class Request:
    """One record of a requests file: its prompt (text, or chat messages), adapter name (None: the default),
    stop strings, max_new_tokens (None: the sampling config's) and line."""

    prompt: str | list
    adapter: str | None
    stop: tuple[str, ...]
    max_new_tokens: int | None
    line: int


def _request(path, line: int, record: dict, names: Sequence[str]) -> Request:
    where = f"{path}:{line}"
    messages, prompt = record.get("messages"), record.get("prompt")
    if (messages is None) == (prompt is None):
        raise JaxtuneError(f"{where}: a request has one of 'prompt' (text) or 'messages' (a chat), "
                           f"{'not both' if messages is not None else 'found neither'}")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise JaxtuneError(f"{where}: key 'messages' must be a non-empty list of {{\"role\", \"content\"}} strings")
    if prompt is not None and not isinstance(prompt, str):
        raise JaxtuneError(f"{where}: key 'prompt' must be a string, got {json.dumps(prompt)[:60]}")
    adapter = record.get("adapter")
    if adapter is not None and adapter not in names:
        known = (f"named with --adapter NAME=DIR: {', '.join(names)}" if names
                 else "no adapter is named (--adapter NAME=DIR)")
        raise JaxtuneError(f"{where}: key 'adapter': unknown adapter {json.dumps(adapter)} ({known})")
    stop = record.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise JaxtuneError(f"{where}: key 'stop' must be a list of non-empty strings, got {json.dumps(stop)[:60]}")
    limit = record.get("max_new_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise JaxtuneError(f"{where}: key 'max_new_tokens' must be a positive integer, got {json.dumps(limit)}")
    chosen = messages if messages is not None else prompt
    assert chosen is not None  # one of the two, checked above
    return Request(chosen, adapter, tuple(stop), limit, line)


def read_requests(path: str | Path, names: Sequence[str] = ()) -> list[Request]:
    """The requests of a JSONL file, each checked: a one-line JaxtuneError names the file:line and the key.
    names: the adapter names a request may give."""
    return [_request(path, line, record, names) for line, record in read_records(path)]


def complete(params: dict, cfg: ModelConfig, tokenizer: Tokenizer, requests: Sequence[Request],
             sampling: SamplingConfig = SamplingConfig(), stop_strings: Sequence[str] = (),
             slots: dict[str, int] | None = None, method=None, chat: bool = False) -> list[str]:
    """Each request's completion, in order: one `generate_text` batch per distinct max_new_tokens, each row with
    its adapter (`slots`: name -> stack slot, for params that carry stacked adapters; else `method`'s), cut before
    the first of `stop_strings` and the request's own stops. chat: text prompts go in as a user turn."""
    texts = [""] * len(requests)  # each row's group fills it
    groups: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(request.max_new_tokens or sampling.max_new_tokens, []).append(i)
    for limit, rows in groups.items():
        prompts = [requests[i].prompt for i in rows]
        if chat:
            prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        names = [requests[i].adapter for i in rows]
        adapter_of_row = None if slots is None else [0 if a is None else slots.get(a, 0) for a in names]
        answers = generate_text(params, cfg, tokenizer, prompts, dataclasses.replace(sampling, max_new_tokens=limit),
                                stop_strings=[(*stop_strings, *requests[i].stop) for i in rows], method=method,
                                adapter_of_row=adapter_of_row)  # a row stops decoding at its strings, cut before them
        for i, text in zip(rows, answers):
            texts[i] = text
    return texts


def generate_file(model: str | Path, data: str | Path, out: str | Path | None = None, *, adapter: str | None = None,
                  adapters: dict[str, str] | None = None, sampling: SamplingConfig = SamplingConfig(),
                  stop_strings: Sequence[str] = (), base: str = "as-trained", chat: bool = False,
                  log: Callable[[str], None] | None = None) -> list[dict]:
    """The answer records of the requests in `data`, also written as JSONL to `out` when given.

    adapter: one adapter directory for every request (any method); adapters: name -> PEFT LoRA directory, stacked
    so each request runs with the one it names (or the base model). The requests are checked before the model loads.
    """
    if adapter is not None and adapters:
        raise JaxtuneError("give one adapter for every request, or named adapters that requests choose from, not both")
    requests = read_requests(data, tuple(adapters or ()))
    tokenizer = load_tokenizer(model)
    if log is not None and tokenizer.chat_template and not chat and any(isinstance(r.prompt, str) for r in requests):
        log(f"note: {model} has a chat template and some requests are raw text prompts; --chat renders each as a "
            "user turn")
    if adapters:
        cfg, params, slots = load_adapters(model, adapters, base=base, log=log)
        method = None
    else:
        (cfg, params, method), slots = load_model_with_adapter(model, adapter, base=base, log=log), None
    texts = complete(params, cfg, tokenizer, requests, sampling, stop_strings, slots, method, chat)
    records = [{"messages" if isinstance(r.prompt, list) else "prompt": r.prompt,
                "adapter": r.adapter if adapters else adapter, "completion": text} for r, text in zip(requests, texts)]
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return records
