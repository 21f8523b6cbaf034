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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.gguf import check_tensor_types, dequantized, gguf_metadata, gguf_reader, tensor_shape
from jaxtune.models.gguf_forms import FORMS, GGUFForm
from jaxtune.models.stacked_experts import INTERLEAVED

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "per_layer_token_embd": "model.embed_tokens_per_layer",  # Gemma 4's per-layer inputs
             "per_layer_model_proj": "model.per_layer_model_projection",
             "per_layer_proj_norm": "model.per_layer_projection_norm"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rope scaling (Gemma 4's proportional RoPE), a factor per frequency
UNROTATED = 1e30  # the factor llama.cpp divides a frequency that proportional RoPE leaves unrotated by
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # a layer's expert stacks, [E, out, in] each
BARE = {"sinks": "weight", "e_score_correction_bias": "bias"}  # transformers' bare parameters -> their GGUF suffix


def hf_tensor_name(name: str, form: GGUFForm = FORMS["llama"]) -> str:
    """transformers' name of GGUF tensor `name` (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    names it does not know are kept, for the shape check to report."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts, names = stem.split("."), form.layer_names()
    if len(parts) == 3 and parts[0] == "blk" and f"{parts[2]}.{suffix}" in names:  # a whole tensor (Gemma 4's)
        return f"model.layers.{parts[1]}.{names[f'{parts[2]}.{suffix}']}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        module = names[parts[2]]
        return f"model.layers.{parts[1]}.{module}" + ("" if module.rpartition(".")[2] in BARE else f".{suffix}")
    return name


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int
                   ) -> np.ndarray:
    """Llama 3.1's rope scaling as llama.cpp stores it, a divisor per frequency [head_dim / 2] (its converter's
    loop: 1 past the high band, `factor` below the low one, the smooth ramp between; Llama 4's bands coincide)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (original / wavelength - low) / (high - low)
        ramp = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, ramp))


def llama3_rope_parameters(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """The Llama 3.1 `rope_scaling` whose per-frequency factors llama.cpp stored as `rope_freqs.weight`.

    llama.cpp keeps only the factors; transformers' config keeps (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings). Llama 3.x releases use low 1 and high 4, Llama 4 low and high 1; the factor
    is the largest stored one, and the original context is found among those Meta used."""
    factor = float(np.max(factors))
    for low, high in ((1.0, 4.0), (1.0, 1.0)):
        for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
            expected = llama3_factors(theta, head_dim, factor, low, high, original)
            if factors.shape == expected.shape and np.allclose(factors, expected, rtol=1e-3):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original, "rope_theta": theta}
    raise JaxtuneError(f"{ROPE_FREQS}: rope factors that no Llama 3 or 4 rope_scaling reproduces")


def proportional_factors(head_dim: int, rotated_fraction: float) -> np.ndarray:
    """Proportional RoPE as llama.cpp's converter stores it [head_dim / 2]: 1 for the first head_dim x fraction / 2
    frequencies, `UNROTATED` for the rest (their angles 0)."""
    rotated = int(head_dim * rotated_fraction / 2)
    return np.asarray([1.0] * rotated + [UNROTATED] * (head_dim // 2 - rotated), np.float32)


def proportional_rope_parameters(factors: np.ndarray) -> dict:
    """The proportional `rope_parameters` entry whose factors llama.cpp stored (`proportional_factors`)."""
    rotated = int(np.sum(factors == 1.0))
    if not np.all(factors[rotated:] >= UNROTATED / 2):
        raise JaxtuneError(f"{ROPE_FREQS}: factors other than 1 then {UNROTATED:g} (proportional RoPE's)")
    return {"rope_type": "proportional", "partial_rotary_factor": rotated / len(factors)}


def gguf_config(path: str | Path) -> dict:
    """A transformers config.json dict of GGUF file `path`, from its metadata (and which tensors it holds)."""
    reader = gguf_reader(path)  # (a URL refused there, before Path() folds its "//")
    path = Path(path)
    meta = gguf_metadata(reader, path)
    form = FORMS.get(meta.get("general.architecture"))  # type: ignore[arg-type]
    if form is None:
        raise JaxtuneError(f"{path}: GGUF architecture {meta.get('general.architecture')!r} is not supported; "
                           f"supported: {', '.join(FORMS)}")
    arch = form.arch

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise JaxtuneError(f"{path}: metadata {arch}.{name} is missing")
        return value

    def first(name: str, default=None):  # a per-layer array's first layer's (the family's form reads the rest)
        value = key(name, default)
        return value[0] if isinstance(value, list) else value

    names = {t.name for t in reader.tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf: dict[str, Any]
    hf = {"architectures": [form.architectures[0]], "model_type": form.model_type, "vocab_size": int(vocab),
          "hidden_size": hidden,  # Qwen3.5-MoE's converter writes its experts' width alone
          "intermediate_size": int(first("feed_forward_length", meta.get(f"{arch}.expert_feed_forward_length"))),
          "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
          "num_key_value_heads": int(first("attention.head_count_kv", heads)), "head_dim": head_dim,
          "max_position_embeddings": int(key("context_length")),
          "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
          "rope_theta": float(key("rope.freq_base", 10000.0)), "tie_word_embeddings": "output.weight" not in names,
          "attention_bias": "blk.0.attn_q.bias" in names}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": float(key("rope.scaling.factor"))}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            hf["rope_scaling"]["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        if scaling == "yarn":  # llama.cpp's defaults where not stored
            hf["rope_scaling"].update(beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                                      beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)))
    if ROPE_FREQS in names:
        factors: np.ndarray = dequantized(next(t for t in reader.tensors if t.name == ROPE_FREQS)).astype(np.float64)
        hf["rope_scaling"] = (proportional_rope_parameters(factors) if form.proportional
                              else llama3_rope_parameters(factors, hf["rope_theta"], head_dim))
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            hf[f"{'pad' if name == 'padding' else name}_token_id"] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    try:
        return {**hf, **form.config_from(key, hf, names)}
    except JaxtuneError as e:  # a value the family's form refuses: named with the file
        raise (e if str(path) in str(e) else JaxtuneError(f"{path}: {e}")) from None


def value_heads_reordered(x: np.ndarray, key_heads: int, value_heads: int, width: int, axis: int = 0,
                          tiled: bool = True) -> np.ndarray:
    """Gated DeltaNet's value heads ([value_heads * width] along `axis`) from transformers' grouped order (each key
    head's r = value_heads / key_heads together) to llama.cpp's tiled one (r rounds of the key heads, as its Qwen3.5
    graph repeats queries and keys); `tiled=False`: back."""
    s, r = x.shape, value_heads // key_heads
    split = (key_heads, r) if tiled else (r, key_heads)
    return np.ascontiguousarray(np.swapaxes(x.reshape(*s[:axis], *split, width, *s[axis + 1:]), axis, axis + 1)
                                .reshape(s))


def permute_qk(rows_x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a Llama query or key projection [heads * head_dim, ...] (weight, bias or LoRA B):
    each head's rows from (first halves, then second halves, as rotate_half pairs them) to interleaved pairs."""
    w = rows_x.reshape(heads, 2, rows_x.shape[0] // heads // 2, *rows_x.shape[1:])
    return w.swapaxes(1, 2).reshape(rows_x.shape)


def unpermute_qk(rows_x: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_qk`: interleaved pairs back to transformers' halves."""
    w = rows_x.reshape(heads, rows_x.shape[0] // heads // 2, 2, *rows_x.shape[1:])
    return w.swapaxes(1, 2).reshape(rows_x.shape)


@dataclass(frozen=True)
class _Source:
    """A transformers tensor made of GGUF tensors `parts`: `build(arrays)` -> the tensor; `experts`: the parts are
    expert stacks, read an expert slice at a time."""

    parts: tuple[Any, ...]
    shape: tuple[int, ...]
    build: Callable[..., np.ndarray]
    experts: bool = False


def _expert_sources(by_name: dict, form: GGUFForm) -> dict[str, _Source]:
    """A mixture's GGUF stacks ([E, out, in] a part: gate, up, down, and their biases) as transformers' stacks:
    gpt-oss's and Llama 4's (`stacked_experts`) `{prefix}.experts.gate_up_proj` [E, in, 2F], gate and up
    interleaved or in halves, `down_proj` [E, F, D], gpt-oss's `_bias` [E, out]; DeepSeek's as transformers 5
    holds them, [E, 2F, D] (gate's rows, then up's) and [E, D, F]."""
    def joined(*a: np.ndarray) -> np.ndarray:
        return np.stack(a, axis=-1).reshape(*a[0].shape[:-1], -1) if form.interleaved else np.concatenate(a, -1)

    out_in = form.architectures[0] not in INTERLEAVED
    sources = {}
    for name in by_name:
        if not (name.startswith("blk.") and name.endswith(".ffn_gate_exps.weight")):
            continue
        layer = name.split(".")[1]
        gate, up, down = (by_name.get(f"blk.{layer}.{part}.weight") for part in EXPERT_PARTS)
        if up is None or down is None:
            raise JaxtuneError(f"{name}: its layer's ffn_up_exps or ffn_down_exps is missing")
        E, F, D = tensor_shape(gate)
        stem = f"model.layers.{layer}.{form.experts}.experts."
        if out_in:
            sources[stem + "gate_up_proj"] = _Source((gate, up), (E, 2 * F, D), lambda *a: np.concatenate(a, 1), True)
            sources[stem + "down_proj"] = _Source((down,), (E, D, F), lambda d: d, True)
        else:
            sources[stem + "gate_up_proj"] = _Source((gate, up), (E, D, 2 * F),
                                                     lambda g, u: joined(g.swapaxes(1, 2), u.swapaxes(1, 2)), True)
            sources[stem + "down_proj"] = _Source((down,), (E, F, D), lambda d: d.swapaxes(1, 2), True)
        biases = [by_name.get(f"blk.{layer}.{part}.bias") for part in EXPERT_PARTS]
        if all(b is not None for b in biases):
            sources[stem + "gate_up_proj_bias"] = _Source(tuple(biases[:2]), (E, 2 * F), joined, True)
            sources[stem + "down_proj_bias"] = _Source(tuple(biases[2:]), (E, D), lambda b: b, True)
    return sources


def _latent_sources(by_name: dict) -> dict[str, _Source]:
    """DeepSeek's key and value expansions, which llama.cpp keeps apart (`attn_k_b` [H, R, dn], each head's
    transposed; `attn_v_b` [H, dv, R]), as transformers' `kv_b_proj` [H * (dn + dv), R] (each head's key rows, then
    its value rows)."""
    sources = {}
    for name, k_b in by_name.items():
        if name.startswith("blk.") and name.endswith(".attn_k_b.weight"):
            layer = name.split(".")[1]
            v_b = by_name.get(f"blk.{layer}.attn_v_b.weight")
            if v_b is None:
                raise JaxtuneError(f"{name}: its layer's attn_v_b is missing")
            (H, R, dn), dv = tensor_shape(k_b), tensor_shape(v_b)[1]
            sources[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = _Source(
                (k_b, v_b), (H * (dn + dv), R), lambda k, v: np.concatenate([k.swapaxes(1, 2), v], 1).reshape(
                    -1, k.shape[1]))
    return sources


def _delta_net_sources(by_name: dict, form: GGUFForm, hf: dict) -> dict[str, _Source]:
    """Qwen3.5's and Qwen3-Next's tensors in transformers' form: norms stored 1 + w back to w (Gated DeltaNet's
    own, stored as it is, aside); its layers' `ssm_a` (-exp A_log) back to A_log, `ssm_conv1d` [C, K] to [C, 1, K],
    Qwen3.5's value heads from tiled back to grouped (`GGUFForm.delta_net`), Qwen3-Next's `attn_qkv` and
    `attn_gate` back into `in_proj_qkvz` (each key head's queries, keys, values, gate) or its older files'
    `ssm_in` as it is; the shared expert's gate [1, D] however stored."""
    nk, nv, hv, D = (hf[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
                                     "hidden_size"))
    qk = 2 * nk * hf["linear_key_head_dim"]

    def grouped(x: np.ndarray, axis: int = 0, width: int = hv) -> np.ndarray:
        return value_heads_reordered(x, nk, nv, width, axis, tiled=False) if form.delta_net == "tiled" else x

    def qk_then_v(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x[:qk], grouped(x[qk:])])

    def fused(qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        return np.concatenate([p.reshape(nk, -1, D) for p in (*np.split(qkv, [qk // 2, qk]), z)], 1).reshape(-1, D)

    heads = {"ssm_a": ("A_log", lambda x: np.log(-grouped(x, 0, 1))),
             "ssm_dt.bias": ("dt_bias", lambda x: grouped(x, 0, 1)),
             "ssm_conv1d.weight": ("conv1d.weight", lambda x: qk_then_v(x)[:, None]),
             "attn_qkv.weight": ("in_proj_qkv.weight", qk_then_v), "attn_gate.weight": ("in_proj_z.weight", grouped),
             "ssm_beta.weight": ("in_proj_b.weight", lambda x: grouped(x, 0, 1)),
             "ssm_alpha.weight": ("in_proj_a.weight", lambda x: grouped(x, 0, 1)),
             "ssm_ba.weight": ("in_proj_ba.weight", lambda x: x),
             "ssm_in.weight": ("in_proj_qkvz.weight", lambda x: x), "ssm_norm.weight": ("norm.weight", lambda x: x),
             "ssm_out.weight": ("out_proj.weight", lambda x: grouped(x, 1))}
    sources = {}
    for name, t in by_name.items():
        layer, _, part = name.removeprefix("blk.").partition(".")
        linear = f"blk.{layer}.ssm_conv1d.weight" in by_name  # attn_qkv: a full layer's fused q, k, v otherwise
        if part in heads and linear:
            module, build = heads[part]
            shape = tensor_shape(t)
            sources[f"model.layers.{layer}.linear_attn.{module}"] = _Source(
                (t,), (shape[0], 1, shape[1]) if module == "conv1d.weight" else shape, build)
        elif part == "ffn_gate_inp_shexp.weight":  # [1, D], or [D] as some converters wrote it
            sources[hf_tensor_name(name, form)] = _Source((t,), (1, D), lambda x: x.reshape(1, -1))
        elif name.endswith("norm.weight") and part != "ssm_norm.weight":
            sources[hf_tensor_name(name, form)] = _Source((t,), tensor_shape(t), lambda x: x - 1)
    for name, z in by_name.items():
        if form.delta_net == "grouped" and name.endswith(".attn_gate.weight"):
            stem = name.removesuffix("attn_gate.weight")
            qkv = by_name[stem + "attn_qkv.weight"]
            layer = f"model.layers.{name.split('.')[1]}.linear_attn."
            del sources[layer + "in_proj_qkv.weight"], sources[layer + "in_proj_z.weight"]
            sources[layer + "in_proj_qkvz.weight"] = _Source(
                (qkv, z), (tensor_shape(qkv)[0] + tensor_shape(z)[0], D), fused)
    return sources


class GGUFCheckpoint:
    """`CheckpointReader`'s interface over a GGUF file: tensors under transformers' names, read whole or by slices,
    dequantised on read (float32 for block-quantised types); a mixture's expert stacks joined as transformers
    holds them, dequantised for the experts read only. Use as a context manager (or `close()`)."""

    def __init__(self, path: str | Path, rename=None):
        """rename(transformers' name) -> the name this reader shows (as `CheckpointReader`'s)."""
        reader = gguf_reader(path)
        self.path = Path(path)
        config = gguf_config(self.path)
        form = FORMS[str(gguf_metadata(reader, self.path)["general.architecture"])]
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        check_tensor_types(reader.tensors, self.path)
        by_name = {t.name: t for t in reader.tensors}
        trunk = config["num_hidden_layers"]  # the multi-token-prediction layers past it are not read
        by_name = {name: t for name, t in by_name.items()
                   if not (name.startswith("blk.") and int(name.split(".")[1]) >= trunk)}
        built = {**_expert_sources(by_name, form), **_latent_sources(by_name),  # from several GGUF tensors
                 **(_delta_net_sources(by_name, form, config) if form.delta_net else {})}
        joined = {t.name for source in built.values() for t in source.parts}
        sources = {hf_tensor_name(t.name, form): _Source((t,), tensor_shape(t), self._unpermuted(
            t.name, heads, form.permuted_qk)) for t in by_name.values() if t.name not in joined | {ROPE_FREQS}}
        sources.update(built)
        self._tensors = {(rename or str)(name): source for name, source in sources.items()}
        self._cached: tuple[tuple, np.ndarray] | None = None
        self.bytes_read = 0

    @staticmethod
    def _unpermuted(name: str, heads: dict, permuted: bool) -> Callable[[np.ndarray], np.ndarray]:
        part = name.split(".")[2] if name.startswith("blk.") else None
        if permuted and part in heads:  # weights and biases alike
            return lambda x: unpermute_qk(x, heads[part])
        return lambda x: x

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

    def _source(self, name: str) -> _Source:
        if name not in self._tensors:
            raise JaxtuneError(f"tensor {name} is not in {self.path}")
        return self._tensors[name]

    def stored_name(self, name: str) -> str:
        return " + ".join(t.name for t in self._source(name).parts)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source(name).shape

    def dtype(self, name: str) -> np.dtype:
        """float16 / bfloat16 / float32 as stored; bfloat16 for MXFP4 (exact), float32 for the other block-quantised
        types (their dequantised dtype)."""
        kind = self._source(name).parts[0].tensor_type.name
        halves = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "MXFP4": ml_dtypes.bfloat16}
        return np.dtype(halves.get(kind, np.float32))

    def stored_type(self, name: str) -> str:
        """The type as llama.cpp names it (Q4_1, Q8_0, F32, MXFP4, ...)."""
        return self._source(name).parts[0].tensor_type.name

    def stored_bytes(self, name: str) -> int:
        return sum(int(t.n_bytes) for t in self._source(name).parts)

    def file_of(self, name: str) -> Path:
        return self.path

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """`tensor[index]` in transformers' layout ([out, in] for a projection); the last tensor (expert slice) read
        is kept, so reading one slice by slice dequantises it once."""
        source, index = self._source(name), tuple(index or ())
        rows = index[0] if source.experts and index else slice(None)
        key = (name, rows.start, rows.stop, rows.step)
        if self._cached is None or self._cached[0] != key:
            parts = (dequantized(t, rows) for t in source.parts)  # MXFP4's values are exact in bfloat16
            self._cached = (key, source.build(*(x.astype(self.dtype(name)) for x in parts)))
            self.bytes_read += sum(int(t.n_bytes) for t in source.parts)
        rest = index[1:] if source.experts and index else index
        return np.ascontiguousarray(self._cached[1][(slice(None),) * bool(source.experts and index) + rest])
