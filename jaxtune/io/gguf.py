"""llama.cpp's GGUF files read as a format: metadata as Python values, tensors as numpy arrays (dequantised from
their blocks on read), the tokenizer's metadata as a dict. What the names mean (transformers' config and tensor
names) is `models/gguf.py`'s; what the tokenizer metadata builds is `data/tokenizer.py`'s.

    reader = gguf_reader(path)            # the parsed file, cached (`forget_readers` drops it)
    meta = gguf_metadata(reader, path)    # {"llama.block_count": 16, ...}, the tokenizer's arrays left out
    w = dequantized(reader.tensors[0])    # float32 (or as stored: float16, bfloat16), dimensions outermost first
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.storage import is_url


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix) rather than a model directory."""
    return str(path).endswith(".gguf")


def gguf_reader(path: str | Path):
    """The file's `gguf.GGUFReader` (memory-mapped; parsing the metadata takes seconds, so the last few are kept)."""
    if is_url(path):
        raise JaxtuneError(f"{path}: a GGUF file is read from a local path (copy it from its bucket first)")
    path = Path(path)
    if not path.is_file():
        raise JaxtuneError(f"{path}: GGUF file not found")
    return _reader(str(path.resolve()), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _reader(path: str, _mtime_ns: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError, struct errors, ... for a broken file
        raise JaxtuneError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def forget_readers() -> None:
    """Drop the parsed files `gguf_reader` keeps, once a run has read what it needs from them: a reader holds a
    Python object for every element of the file's metadata arrays and the mapped pages of every tensor read, about
    230 MiB for SmolLM2-135M's 98 MB file (its 49,152-token vocabulary and merges), resident for as long as it is
    cached."""
    _reader.cache_clear()
    gc.collect()  # the reader's objects refer to each other


def gguf_metadata(reader, path: Path, skip: tuple[str, ...] = ("tokenizer.ggml.",)) -> dict:
    """Every metadata value but the tokenizer's long arrays (scalars as Python values, arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith(skip) and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            if not key.endswith(("_id", "add_bos_token", "add_eos_token", "add_space_prefix")):
                continue
        try:
            out[key] = field.contents()
        except Exception as e:
            raise JaxtuneError(f"{path}: metadata {key} cannot be read ({e})") from None
    return out


def tensor_shape(tensor) -> tuple[int, ...]:
    """The tensor's shape outermost dimension first (numpy's and transformers' order)."""
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first


def dequantized(tensor, rows: slice = slice(None)) -> np.ndarray:
    """The tensor (`rows` of its outermost dimension) in numpy's layout: float32, or float16 / bfloat16 when it is
    stored so; only those rows are dequantised."""
    from gguf import GGMLQuantizationType, quants

    kind, shape = tensor.tensor_type, tensor_shape(tensor)
    data = np.asarray(tensor.data).reshape(shape[0], -1)[rows]
    if kind == GGMLQuantizationType.BF16:
        data = data.view(ml_dtypes.bfloat16)
    elif kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = quants.dequantize(data, kind)
    return data.reshape(-1, *shape[1:])


def check_tensor_types(tensors, path: Path) -> None:
    """Every tensor type in the file can be read: each distinct type is tried on one zero block, so a file with a
    type nothing here dequantises fails on opening, naming a tensor of that type, not minutes into a load."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    for kind in {t.tensor_type for t in tensors} - {GGMLQuantizationType.F32, GGMLQuantizationType.F16}:
        block, size = GGML_QUANT_SIZES[kind]
        try:
            quants.dequantize(np.zeros((1, size), np.uint8), kind)
        except (NotImplementedError, ValueError):
            name = next(t.name for t in tensors if t.tensor_type == kind)
            raise JaxtuneError(f"{path}: tensor {name} has type {kind.name}, which jaxtune cannot dequantise "
                               "(float and block-quantised types only)") from None


def gguf_tokenizer_metadata(path: str | Path) -> dict:
    """The tokenizer a GGUF file describes, under llama.cpp's key names less `tokenizer.ggml.` (`model`, `pre`,
    `tokens`, `token_type`, `merges`, `scores`, `bos_token_id`, ..., `add_bos_token`, `add_space_prefix`) and
    `chat_template`; absent keys are left out."""
    fields = gguf_reader(path).fields
    path = Path(path)
    out = {}
    for key, field in fields.items():
        if key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template":
            try:
                out[key.rpartition(".")[2]] = field.contents()
            except Exception as e:
                raise JaxtuneError(f"{path}: metadata {key} cannot be read ({e})") from None
    if "tokens" not in out:
        raise JaxtuneError(f"{path}: no tokenizer (metadata tokenizer.ggml.tokens is missing)")
    return out
