"""Tokenizers (`Tokenizer`: text <-> ids with BOS, EOS, pad and the chat template), from `load_tokenizer(path)`: a
model's own `tokenizer.json` through the `tokenizers` library, the one a GGUF file describes (`gguf_tokenizer`), or
the built-in byte-level one when a directory ships none.

Special tokens come from the model's files, in transformers' order of precedence: `tokenizer_config.json`
(`bos_token`, `eos_token`, `pad_token`), then `special_tokens_map.json`, then the ids in `config.json`; with no pad
token, EOS pads. The built-in tokenizer (`Tokenizer.byte_level`) is a byte-level BPE with no merges: ids 0..2 are
`<pad>`, `<s>`, `</s>`, then the 256 bytes, so any text round-trips; `save` writes it for transformers too.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from jaxtune.errors import JaxtuneError
from jaxtune.io.gguf import gguf_tokenizer_metadata, is_gguf
from jaxtune.io.json import read_json
from jaxtune.io.storage import is_url, local_model_dir

BYTE_SPECIALS = ("<pad>", "<s>", "</s>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")  # what a model directory's tokenizer is, as `copy_tokenizer` copies it


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

    def tokens_containing(self, strings) -> list[int]:
        """Ids of the tokens whose own text (special tokens skipped) holds one of `strings`: a text that ends with
        such a token holds that string, so generation may stop there (a string spread over tokens is not found)."""
        strings = tuple(s for s in strings if s)
        return [i for i, text in enumerate(self._texts()) if any(s in text for s in strings)] if strings else []

    @functools.cache  # noqa: B019 (one decode of the vocabulary per tokenizer, kept as long as it is)
    def _texts(self) -> list[str]:
        return self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=True)

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
    """The tokenizer of a model directory (the built-in byte-level tokenizer when it ships no `tokenizer.json`) or
    of a GGUF file."""
    if is_gguf(directory):
        return gguf_tokenizer(directory)
    directory = local_model_dir(directory) if is_url(directory) else Path(directory)
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


# The split a GGUF vocabulary's merges were learned under, by llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`),
# as transformers' GGUF loader reads them; other names split as GPT-2 does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp's token types


def _gguf_byte_level(meta: dict) -> Backend:
    """A GGUF "gpt2" vocabulary: byte-level BPE with the file's merges (tokens not already in the byte alphabet
    spelled in it)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling)
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ")) for m in meta.get("merges", [])]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = GGUF_SPLITS.get(meta.get("pre", ""))
    backend.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                             pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                               use_regex=False)]))
    backend.decoder = decoders.ByteLevel()
    return backend


def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, best score first
    (transformers' `generate_merges`)."""
    index = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in index
                 and token[k:] in index]
        merges += sorted(pairs, key=lambda p: (index[p[0]], index[p[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _gguf_sentencepiece(meta: dict) -> Backend:
    """A GGUF "llama" vocabulary (SentencePiece BPE, as Llama 2 and Mistral ship): byte fallback, spaces as
    U+2581 with one prepended to the text, merges from the file or from the scores."""
    tokens = meta["tokens"]
    merges = ([tuple(m.split(" ")) for m in meta["merges"]] if "merges" in meta else
              _score_merges(tokens, meta.get("scores") or [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[meta["unknown_token_id"]] if "unknown_token_id" in meta else None  # where bytes cannot help
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


GEMMA4_SPLIT = r"[^\n]+|[\n]+"  # llama.cpp's "gemma4" pre-tokenizer: runs of newlines apart from the rest


def _gguf_gemma4(meta: dict) -> Backend:
    """A GGUF "gemma4" vocabulary (Gemma 4's, as llama.cpp reads it): BPE over UTF-8 with byte fallback and the
    file's merges, spaces as U+2581 with none prepended, newline runs split from the rest."""
    backend = _gguf_sentencepiece({**meta, "add_space_prefix": False})
    backend.pre_tokenizer = pre_tokenizers.Sequence([backend.pre_tokenizer, pre_tokenizers.Split(
        Regex(GEMMA4_SPLIT), behavior="isolated")])
    return backend


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (byte-level "gpt2", SentencePiece "llama" or "gemma4"),
    built as transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds it: control tokens added as
    special tokens, user-defined ones (`<think>`) as plain added tokens, BOS prepended where the file says so
    (SentencePiece vocabularies by default), and the file's chat template."""
    meta = gguf_tokenizer_metadata(path)
    kind = meta.get("model")
    builders = {"gpt2": _gguf_byte_level, "llama": _gguf_sentencepiece, "gemma4": _gguf_gemma4}
    if kind not in builders:
        raise JaxtuneError(f"{path}: GGUF tokenizer model {kind!r} is not supported ({', '.join(builders)})")
    backend = builders[kind](meta)
    tokens, types = meta["tokens"], meta.get("token_type") or []
    alphabet = set(_bytes_to_unicode()) if kind == "gpt2" else None
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                                if k == GGUF_CONTROL and (alphabet is None or set(t) <= alphabet)])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                        if k == GGUF_USER_DEFINED])
    ids = {name: meta.get(f"{name}_token_id") for name in ("bos", "eos", "padding")}
    bos = ids["bos"]
    add_bos = (kind == "gemma4" or bool(meta.get("add_bos_token", kind == "llama"))) and bos is not None  # forced
    add_eos = bool(meta.get("add_eos_token", False)) and ids["eos"] is not None
    if add_bos or add_eos:
        first = [tokens[bos]] if add_bos else []
        last = [tokens[ids["eos"]]] if add_eos else []
        single = " ".join(first + ["$A"] + last)
        pair = " ".join(first + ["$A"] + last + first + ["$B:1"] + last)
        specials = [(tokens[i], i) for i in {*([bos] if add_bos else []), *([ids["eos"]] if add_eos else [])}]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return Tokenizer(backend, bos, ids["eos"], ids["padding"], meta.get("chat_template"))


def copy_tokenizer(source: str | Path | None, directory: str | Path) -> None:
    """The tokenizer files of model directory `source` (if given) copied into `directory`, beside the weights a
    `save_model` wrote there; a GGUF file's tokenizer written as `tokenizer.json` and `tokenizer_config.json`."""
    if source is None:
        return
    if is_gguf(source):
        return gguf_tokenizer(source).save(directory)
    source = local_model_dir(source) if is_url(source) else Path(source)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, Path(directory) / name)
