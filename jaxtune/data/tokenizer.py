"""Tokenizers: a model's own `tokenizer.json` through the `tokenizers` library, or a built-in byte-level one.

Special tokens come from the model's files, in transformers' order of precedence: `tokenizer_config.json`
(`bos_token`, `eos_token`, `pad_token`), then `special_tokens_map.json`, then the ids in `config.json`.
When a model names no pad token, the EOS id pads (padding is masked out, so its id never matters).

The built-in tokenizer is a real `tokenizers` byte-level BPE with no merges: ids 0..2 are `<pad>`, `<s>`,
`</s>` and ids 3..258 the 256 bytes, so any text round-trips. It is saved as a `tokenizer.json` that
transformers' `PreTrainedTokenizerFast` loads too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxtune.errors import JaxtuneError
from jaxtune.models.hf_config import read_json

BYTE_SPECIALS = ("<pad>", "<s>", "</s>")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, which the `ByteLevel` pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_level_backend() -> Backend:
    """The built-in tokenizer: 3 special tokens, then byte b as id 3 + b; BOS prepended on encode."""
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab.update({ch: len(BYTE_SPECIALS) + b for b, ch in enumerate(_bytes_to_unicode())})
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(list(BYTE_SPECIALS))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return backend


class Tokenizer:
    """Text <-> ids with the model's BOS, EOS and pad ids.

    encode(text, add_special_tokens=True) -> list[int]; decode(ids, skip_special_tokens=True) -> str.
    """

    def __init__(self, backend: Backend, bos_id: int | None, eos_id: int | None, pad_id: int | None,
                 chat_template: str | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.chat_template = chat_template

    @classmethod
    def byte_level(cls) -> Tokenizer:
        return cls(byte_level_backend(), bos_id=1, eos_id=2, pad_id=0)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json` naming the special tokens."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        names = {k: self.backend.id_to_token(v) for k, v in
                 (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id)) if v is not None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of a model directory; the built-in byte-level tokenizer when it ships no `tokenizer.json`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise JaxtuneError(f"{directory}: model directory not found")
    path = directory / "tokenizer.json"
    if not path.is_file():
        return Tokenizer.byte_level()
    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for malformed files
        raise JaxtuneError(f"{path}: not a readable tokenizer ({e})") from None
    tok_config = _read(directory / "tokenizer_config.json")
    special_map = _read(directory / "special_tokens_map.json")
    model_config = _read(directory / "config.json")

    def special_id(name: str) -> int | None:
        content = _token_content(tok_config.get(name)) or _token_content(special_map.get(name))
        if content is not None:
            token_id = backend.token_to_id(content)
            if token_id is None:
                raise JaxtuneError(f"{directory}: {name} {content!r} is not in tokenizer.json's vocabulary")
            return token_id
        value = model_config.get(f"{name}_id")
        return value[0] if isinstance(value, list) else value

    template = tok_config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    return Tokenizer(backend, special_id("bos_token"), special_id("eos_token"), special_id("pad_token"), template)
