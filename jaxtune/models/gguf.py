"""llama.cpp's GGUF files as a model source, wherever a Hugging Face model directory is accepted: GGUF's names in
transformers' terms (the format itself: `io/gguf.py`; its tokenizer: `data/tokenizer.gguf_tokenizer`).

    hf = gguf_config(path)                 # a config.json dict (architectures, sizes, rope), for config_from_hf
    with GGUFCheckpoint(path) as reader:   # CheckpointReader's interface under transformers' tensor names
        w = reader.read("model.layers.0.self_attn.q_proj.weight")   # [out, in] float32, dequantised

Tensors are dequantised one at a time as they are read, so the float model never exists whole beside the file; a
Llama's query and key rows, interleaved for llama.cpp's rotary kernel, are put back in order (`unpermute_qk`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.gguf import check_tensor_types, dequantized, gguf_metadata, gguf_reader, tensor_shape

# GGUF architecture -> (transformers class, model_type); llama.cpp writes Mistral's dense models as "llama".
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
                 "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
PERMUTED_QK = ("llama", "mistral")  # architectures whose q/k rows llama.cpp interleaves
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rope scaling, stored as a factor per frequency


def hf_tensor_name(name: str) -> str:
    """transformers' name of GGUF tensor `name` (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    names it does not know are kept, for the shape check to report."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return name


def llama3_rope_parameters(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """The Llama 3.1 `rope_scaling` whose per-frequency factors llama.cpp stored as `rope_freqs.weight`.

    llama.cpp keeps only the factors; transformers' config keeps (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings). Every Llama 3.x release uses low 1 and high 4; the factor is the largest
    stored one, and the original context is found among those Meta used."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    factor = float(np.max(factors))
    for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        low, high = 1.0, 4.0
        smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        expected = 1.0 / ((1 - smooth) / factor + smooth)
        if factors.shape == expected.shape and np.allclose(factors, expected, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original, "rope_theta": theta}
    raise JaxtuneError(f"{ROPE_FREQS}: rope factors that no Llama 3 rope_scaling (low 1, high 4) reproduces")


def gguf_config(path: str | Path) -> dict:
    """A transformers config.json dict of GGUF file `path`, from its metadata (and which tensors it holds)."""
    path = Path(path)
    reader = gguf_reader(path)
    meta = gguf_metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise JaxtuneError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                           f"{', '.join(ARCHITECTURES)}")
    cls, model_type = ARCHITECTURES[arch]

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise JaxtuneError(f"{path}: metadata {arch}.{name} is missing")
        return value

    names = {t.name for t in reader.tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf: dict[str, Any]
    hf = {"architectures": [cls], "model_type": model_type, "vocab_size": int(vocab), "hidden_size": hidden,
          "intermediate_size": int(key("feed_forward_length")), "num_hidden_layers": int(key("block_count")),
          "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
          "head_dim": head_dim, "max_position_embeddings": int(key("context_length")),
          "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
          "rope_theta": float(key("rope.freq_base", 10000.0)), "tie_word_embeddings": "output.weight" not in names,
          "attention_bias": "blk.0.attn_q.bias" in names}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": float(key("rope.scaling.factor"))}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            hf["rope_scaling"]["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    if ROPE_FREQS in names:
        factors: np.ndarray = dequantized(next(t for t in reader.tensors if t.name == ROPE_FREQS)).astype(np.float64)
        hf["rope_scaling"] = llama3_rope_parameters(factors, hf["rope_theta"], head_dim)
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            hf[f"{'pad' if name == 'padding' else name}_token_id"] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    return hf


def permute_qk(rows_x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a Llama query or key projection [heads * head_dim, ...] (weight, bias or LoRA B):
    each head's rows from (first halves, then second halves, as rotate_half pairs them) to interleaved pairs."""
    w = rows_x.reshape(heads, 2, rows_x.shape[0] // heads // 2, *rows_x.shape[1:])
    return w.swapaxes(1, 2).reshape(rows_x.shape)


def unpermute_qk(rows_x: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_qk`: interleaved pairs back to transformers' halves."""
    w = rows_x.reshape(heads, rows_x.shape[0] // heads // 2, 2, *rows_x.shape[1:])
    return w.swapaxes(1, 2).reshape(rows_x.shape)


class GGUFCheckpoint:
    """`CheckpointReader`'s interface over a GGUF file: tensors under transformers' names, read whole or by slices,
    dequantised on read (float32 for block-quantised types). Use as a context manager (or `close()`)."""

    def __init__(self, path: str | Path, rename=None):
        """rename(transformers' name) -> the name this reader shows (as `CheckpointReader`'s)."""
        self.path = Path(path)
        reader = gguf_reader(self.path)
        config = gguf_config(self.path)
        self._heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        self._permuted = config["model_type"] in PERMUTED_QK
        check_tensor_types(reader.tensors, self.path)
        self._tensors = {(rename or str)(hf_tensor_name(t.name)): t for t in reader.tensors if t.name != ROPE_FREQS}
        self._cached: tuple[str, np.ndarray] | None = None
        self.bytes_read = 0

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        self._cached = None

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise JaxtuneError(f"tensor {name} is not in {self.path}")
        return self._tensors[name]

    def stored_name(self, name: str) -> str:
        return self._tensor(name).name

    def shape(self, name: str) -> tuple[int, ...]:
        return tensor_shape(self._tensor(name))

    def dtype(self, name: str) -> np.dtype:
        """float16 / bfloat16 / float32 as stored; float32 for block-quantised tensors (their dequantised dtype)."""
        kind = self._tensor(name).tensor_type.name
        return np.dtype({"F16": np.float16, "BF16": ml_dtypes.bfloat16}.get(kind, np.float32))

    def stored_type(self, name: str) -> str:
        """The type as llama.cpp names it (Q4_1, Q8_0, F32, ...)."""
        return self._tensor(name).tensor_type.name

    def stored_bytes(self, name: str) -> int:
        return int(self._tensor(name).n_bytes)

    def file_of(self, name: str) -> Path:
        return self.path

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """`tensor[index]` in transformers' layout ([out, in] for a projection); the last tensor read is kept, so
        reading one tensor slice by slice dequantises it once."""
        if self._cached is None or self._cached[0] != name:
            tensor = self._tensor(name)
            whole = dequantized(tensor)
            part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
            if self._permuted and part in self._heads:  # weights and biases alike
                whole = unpermute_qk(whole, self._heads[part])
            self.bytes_read += int(tensor.n_bytes)
            self._cached = (name, whole)
        return np.ascontiguousarray(self._cached[1][tuple(index or ())])

