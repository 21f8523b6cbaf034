"""A model as a GGUF file that llama.cpp (and Ollama, LM Studio, transformers) loads (`save_gguf`); a method that
has a GGUF adapter form writes it itself (`Method.gguf_lora`: LoRA's `lora/gguf.py`).

    save_gguf("model.gguf", cfg, params, tokenizer, kind="q4_k_m")   # kind: one of KINDS

The inverse of `models/gguf.py`, as llama.cpp's `convert_hf_to_gguf.py` writes it: the config as `{arch}.*`
metadata, the tokenizer as `tokenizer.ggml.*`, the tensors under llama.cpp's names (a Llama's query and key rows
interleaved), converted and written one at a time after a header built from shapes: no second copy of the model.
The quantised kinds are llama-quantize's file types: its mixture of types (`gguf_mixture.py`), its bytes.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.data.tokenizer import GGUF_CONTROL, GGUF_SPLITS, GGUF_USER_DEFINED, Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.io.gguf_kquants import BLOCK_BYTES, quantize_rows
from jaxtune.methods.gguf_mixture import MIXTURES, tensor_types
from jaxtune.models.gguf import (
    BARE,
    ROPE_FREQS,
    TOP_NAMES,
    llama3_factors,
    permute_qk,
    proportional_factors,
    value_heads_reordered,
)
from jaxtune.models.gguf_forms import FORMS, GGUFForm, form_of
from jaxtune.models.hf_weights import tensor_entries
from jaxtune.models.stacked_experts import INTERLEAVED
from jaxtune.paths import writing

KINDS = ("f32", "f16", "bf16", "q8_0", *MIXTURES)
GGUF_NORMAL, GGUF_UNUSED, GGUF_BYTE = 1, 5, 6  # llama.cpp's token types (control and user-defined: data/tokenizer.py)
# Gemma 4's tags its converter marks user-defined, so llama.cpp renders them (its chat parser reads them)
GEMMA4_VISIBLE = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                  '<|"|>')
_TOP = {hf: gguf for gguf, hf in TOP_NAMES.items()}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def gguf_tensor_name(hf_name: str, form: GGUFForm) -> str:
    """llama.cpp's name of a transformers tensor (`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    modules = {hf: gguf for gguf, hf in form.layer_names().items()}
    whole = {hf: gguf for hf, gguf in modules.items() if "." in gguf}  # Gemma 4's router scales, experts, scalar
    _, _, layer, rest = hf_name.split(".", 3)
    if rest in whole:
        return f"blk.{layer}.{whole[rest]}"
    if suffix in BARE:  # gpt-oss's sinks, DeepSeek's routing bias
        stem, suffix = hf_name, BARE[suffix]
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{modules[module]}.{suffix}"


def gguf_form(cfg: ModelConfig) -> GGUFForm:
    """The form `cfg` is written in, or a one-line refusal naming what GGUF (llama.cpp's loader) cannot express."""
    form = form_of(cfg.architecture)
    yarn = form.yarn if form is not None else None
    scalings = ("proportional",) if form is not None and form.proportional else ("linear", "llama3") + (
        ("yarn",) if yarn else ())
    s = cfg.rope_scaling
    attention = []  # a YaRN attention factor other than the one llama.cpp's loader gives
    if yarn is not None and s is not None and s.kind == "yarn" and not math.isclose(
            s.attention_factor, yarn(s.factor), rel_tol=1e-6):
        attention = [f"a YaRN attention factor {s.attention_factor:.4g} (llama.cpp's: {yarn(s.factor):.4g})"]
    problems = {"an architecture llama.cpp's GGUF writer here does not cover": form is None,
                "sliding-window layers": any(cfg.sliding_windows) and not (form is not None and form.windows),
                f"rope scaling {s and s.kind!r}": s is not None and s.kind not in scalings,
                "an MLP bias": cfg.mlp_bias,
                "an output-projection bias": cfg.o_bias and not (form is not None and form.output_bias)}
    found = [what for what, bad in problems.items() if bad] + attention + (form.refused(cfg) if form else [])
    if found:
        raise JaxtuneError(f"{cfg.architecture}: cannot be written as GGUF ({'; '.join(found)}); supported: "
                           f"{', '.join(dict.fromkeys(c for f in FORMS.values() for c in f.architectures))}")
    assert form is not None  # a problem above otherwise
    return form


def gguf_entries(hf_name: str, shape: tuple[int, ...], produce, form: GGUFForm, cfg: ModelConfig) -> list[tuple]:
    """(GGUF name, shape, produce) of a transformers tensor: an expert stack split as llama.cpp's converter splits
    it (gpt-oss's and Llama 4's `gate_up_proj` [E, D, 2F] -> gate's and up's [E, F, D], `down_proj` [E, F, D] ->
    [E, D, F], biases likewise; transformers 5's [E, 2F, D] and [E, D, F] as they are), a layer's stack gathered
    once for its parts; DeepSeek's `kv_b_proj` as llama.cpp's key and value expansions (`_kv_b_entries`); Gated
    DeltaNet's as `_delta_net_entries`; norms stored 1 + w where the form's are (`unit_norms`)."""
    if hf_name.endswith(".self_attn.kv_b_proj.weight"):
        return _kv_b_entries(hf_name, produce, cfg)
    if ".linear_attn." in hf_name:
        return _delta_net_entries(hf_name, shape, produce, form, cfg)
    if form.unit_norms and hf_name.endswith("norm.weight"):
        return [(gguf_tensor_name(hf_name, form), shape, lambda: produce() + np.float32(1))]
    match = _EXPERT.match(hf_name)
    if match is None:
        return [(gguf_tensor_name(hf_name, form), shape, produce)]
    layer, stack, bias = match[1], match[2], bool(match[3])
    suffix = "bias" if bias else "weight"
    if not bias and form.architectures[0] in INTERLEAVED:  # stored [E, in, out]
        shape, stored = (shape[0], shape[2], shape[1]), produce
        produce = lambda: stored().swapaxes(1, 2)  # noqa: E731
    if stack == "down_proj":
        return [(f"blk.{layer}.ffn_down_exps.{suffix}", shape, produce)]
    stack = _gathered_once(produce, 2)  # [E, 2F] or [E, 2F, D]

    def part(j: int):
        x = stack()
        F = x.shape[1] // 2
        return np.ascontiguousarray(x[:, j::2] if form.interleaved else x[:, j * F:(j + 1) * F])

    return [(f"blk.{layer}.ffn_{name}_exps.{suffix}", (shape[0], shape[1] // 2, *shape[2:]), lambda j=j: part(j))
            for j, name in enumerate(("gate", "up"))]


def _gathered_once(produce, uses: int):
    """produce() for `uses` calls in turn (a tensor written as several GGUF tensors), gathered at the first and let go
    after the last."""
    held: list = []

    def get():
        if not held:
            held.extend([produce(), 0])
        held[1] += 1
        x = held[0]
        if held[1] == uses:
            held.clear()
        return x

    return get


def _kv_b_entries(hf_name: str, produce, cfg: ModelConfig) -> list[tuple]:
    """`kv_b_proj` [H * (dn + dv), R] (each head's key rows, then its value rows) as llama.cpp's converter splits it:
    `attn_k_b` [H, R, dn] (each head's key expansion transposed, for its queries' absorption into the latent) and
    `attn_v_b` [H, dv, R]."""
    layer = hf_name.split(".")[2]
    H, dn, dv, R = cfg.num_heads, cfg.head_dim - cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    whole = _gathered_once(produce, 2)
    heads = lambda: whole().reshape(H, dn + dv, R)  # noqa: E731
    return [(f"blk.{layer}.attn_k_b.weight", (H, R, dn), lambda: np.ascontiguousarray(heads()[:, :dn].swapaxes(1, 2))),
            (f"blk.{layer}.attn_v_b.weight", (H, dv, R), lambda: np.ascontiguousarray(heads()[:, dn:]))]


def _delta_net_entries(hf_name: str, shape: tuple[int, ...], produce, form: GGUFForm, cfg: ModelConfig
                       ) -> list[tuple]:
    """A Gated DeltaNet tensor as llama.cpp's converter writes it: A_log as `ssm_a` = -exp(A_log), `conv1d` [C, 1, K]
    squeezed; Qwen3.5's value heads from grouped (each key head's r together) to tiled (r rounds of the key heads,
    as its graph repeats queries and keys) wherever they index rows or columns; Qwen3-Next's `in_proj_qkvz` (each
    key head's queries, keys, values, gate) split into `attn_qkv` (every query, key, value) and `attn_gate`."""
    layer, module = hf_name.split(".")[2], hf_name.split(".", 4)[4]
    nk, nv, hv, D = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.hidden_size
    qk, blk = 2 * nk * cfg.linear_key_head_dim, f"blk.{layer}."

    def tiled(x: np.ndarray, axis: int = 0, width: int = hv) -> np.ndarray:
        return value_heads_reordered(x, nk, nv, width, axis) if form.delta_net == "tiled" else x

    def qk_then_v(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x[:qk], tiled(x[qk:])])

    if module == "in_proj_qkvz.weight":
        whole = _gathered_once(produce, 2)

        def part(gate: bool) -> np.ndarray:
            q, k, v, z = np.split(whole().reshape(nk, -1, D), np.cumsum([qk // 2 // nk] * 2 + [nv // nk * hv]), 1)
            return np.concatenate([x.reshape(-1, D) for x in ((z,) if gate else (q, k, v))])

        return [(blk + "attn_qkv.weight", (qk + nv * hv, D), lambda: part(False)),
                (blk + "attn_gate.weight", (nv * hv, D), lambda: part(True))]
    name, out, build = {
        "A_log": ("ssm_a", shape, lambda x: tiled(-np.exp(x), 0, 1)),
        "dt_bias": ("ssm_dt.bias", shape, lambda x: tiled(x, 0, 1)),
        "conv1d.weight": ("ssm_conv1d.weight", (shape[0], shape[-1]), lambda x: qk_then_v(x[:, 0])),
        "in_proj_qkv.weight": ("attn_qkv.weight", shape, qk_then_v),
        "in_proj_z.weight": ("attn_gate.weight", shape, tiled),
        "in_proj_b.weight": ("ssm_beta.weight", shape, lambda x: tiled(x, 0, 1)),
        "in_proj_a.weight": ("ssm_alpha.weight", shape, lambda x: tiled(x, 0, 1)),
        "in_proj_ba.weight": ("ssm_ba.weight", shape, lambda x: x),
        "norm.weight": ("ssm_norm.weight", shape, lambda x: x),
        "out_proj.weight": ("ssm_out.weight", shape, lambda x: tiled(x, 1))}[module]
    return [(blk + name, out, lambda: build(produce()))]


def _add_config(writer, cfg: ModelConfig, kind: str, form: GGUFForm) -> None:
    """The config as `{arch}.*` metadata: the keys every architecture shares, with the form's own over them (each
    key written once, in the type llama.cpp's loader checks: u32, f32, bool, string or array)."""
    import gguf
    from gguf import LlamaFileType

    keys: dict[str, Any] = {
        "block_count": cfg.num_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_heads, "attention.head_count_kv": cfg.num_kv_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.dimension_count": cfg.head_dim, "rope.freq_base": float(cfg.rope_theta),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "vocab_size": cfg.vocab_size}
    if cfg.num_experts:
        keys.update(expert_count=cfg.num_experts, expert_used_count=cfg.experts_per_token)
    s = cfg.rope_scaling
    if s is not None and s.kind in ("linear", "yarn"):
        keys.update({"rope.scaling.type": s.kind, "rope.scaling.factor": float(s.factor)})
    if s is not None and s.kind == "yarn":
        keys.update({"rope.scaling.original_context_length": s.original_max_position_embeddings,
                     "rope.scaling.yarn_beta_fast": float(s.beta_fast),
                     "rope.scaling.yarn_beta_slow": float(s.beta_slow)})
    for name, value in {**keys, **form.metadata(cfg)}.items():
        key = f"{form.arch}.{name}"
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    file_types = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
                  "q8_0": LlamaFileType.MOSTLY_Q8_0, **{k: file_type for k, (file_type, _) in MIXTURES.items()}}
    writer.add_file_type(file_types[kind])
    if kind in MIXTURES:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _pre_tokenizer_name(backend: dict) -> str:
    """llama.cpp's name of the split a byte-level tokenizer makes (`tokenizer.ggml.pre`)."""
    pre = backend.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    for step in steps:
        pattern = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        for name, split in GGUF_SPLITS.items():
            if pattern == split:
                return name
    if any(step.get("type") == "Digits" for step in steps):
        return "smollm"  # digits one by one, then GPT-2's split
    if any(step.get("type") == "ByteLevel" and step.get("use_regex", True) for step in steps):
        return "gpt-2"
    return "default"


def _add_tokenizer(writer, tokenizer: Tokenizer, vocab_size: int, form: GGUFForm) -> None:
    """A byte-level BPE tokenizer as `tokenizer.ggml.*` ("gpt2"), or a byte-fallback one (spaces as U+2581) as the
    form's (`spm_vocab`) as llama.cpp's converter writes Gemma 4's (`LlamaHfVocab`): scores -1000, `<0xXX>` tokens
    BYTE, Gemma 4's visible tags USER_DEFINED, a space in a merge as U+0120, no space prefix, BOS added. The
    vocabulary padded with unused `[PAD{i}]` tokens to the model's embedding rows, as the converter pads it."""
    backend = json.loads(tokenizer.backend.to_str())
    model = backend["model"]
    spm = bool(model.get("type") == "BPE" and model.get("byte_fallback") and form.spm_vocab)
    if not spm and (model.get("type") != "BPE" or model.get("byte_fallback")):
        raise JaxtuneError("the tokenizer is not a byte-level BPE (a SentencePiece vocabulary): writing it as GGUF "
                           "is not supported")
    tokens = {i: t for t, i in model["vocab"].items()}
    types = {i: GGUF_BYTE if spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t) else GGUF_NORMAL for i, t in tokens.items()}
    for added in backend.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = GGUF_CONTROL if added["special"] else GGUF_USER_DEFINED
    size = max(vocab_size, max(tokens) + 1)
    space = "\u0120" if spm else " "  # the converter's for a space inside a merge's part
    merges = [m if isinstance(m, str) else " ".join(p.replace(" ", space) for p in m) for m in model.get("merges", [])]
    writer.add_tokenizer_model(form.spm_vocab if spm else "gpt2")
    if spm:
        types.update({i: GGUF_USER_DEFINED for i, t in tokens.items() if t in GEMMA4_VISIBLE})
        writer.add_token_scores([-1000.0] * size)
    else:
        writer.add_tokenizer_pre(_pre_tokenizer_name(backend))
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(size)])
    writer.add_token_types([types.get(i, GGUF_UNUSED) for i in range(size)])
    writer.add_token_merges(merges)
    for add, value in ((writer.add_bos_token_id, tokenizer.bos_id), (writer.add_eos_token_id, tokenizer.eos_id),
                       (writer.add_pad_token_id, tokenizer.pad_id),
                       (writer.add_unk_token_id, model["vocab"].get(model.get("unk_token")) if spm else None)):
        if value is not None:
            add(value)
    if spm:
        writer.add_add_space_prefix(False)
    ids = tokenizer.encode("a")
    writer.add_add_bos_token(spm or (bool(ids) and ids[0] == tokenizer.bos_id and tokenizer.bos_id is not None))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _ggml_type(name: str, shape: tuple[int, ...], kind: str):
    """The GGML type a tensor is written in: vectors, biases, norms, routers and Gated DeltaNet's convolution in
    float32 (as llama.cpp's converter keeps them); a matrix whose rows are not whole Q8_0 blocks (32 values) in
    float16."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) == 1 or kind == "f32" or not name.endswith(".weight") or "_norm." in name or "ffn_gate_inp" in name \
            or "ssm_conv1d" in name:
        return Q.F32
    if kind == "q8_0" and shape[-1] % 32:
        return Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[kind]


def _ggml_types(entries: list[tuple], kind: str, cfg: ModelConfig, form: GGUFForm) -> dict[str, Any]:
    """GGML type of each tensor: llama-quantize's mixture for a quantised kind (a tensor it does not quantise as
    the f16 file has it), else `_ggml_type`."""
    shapes = [(name, tuple(shape)) for name, shape, _ in entries]
    if kind not in MIXTURES:
        return {name: _ggml_type(name, shape, kind) for name, shape in shapes}
    mixture = tensor_types(shapes, kind, layers=cfg.num_layers, experts=cfg.num_experts or 0,
                           big_llama=form.arch == "llama" and cfg.num_layers == 80 and cfg.num_kv_heads < cfg.num_heads)
    return {name: mixture[name] or _ggml_type(name, shape, "f16") for name, shape in shapes}


def _tensor_info(shape: tuple[int, ...], qtype) -> tuple[tuple[int, ...], np.dtype, int, object]:
    """(shape, dtype, bytes) of the array written for a tensor of `shape` in `qtype`, and the type (block types and
    BF16 are written as bytes)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if qtype in (Q.F32, Q.F16):
        dtype = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
        return shape, dtype, int(np.prod(shape)) * dtype.itemsize, qtype
    byte_shape = quants.quant_shape_to_byte_shape(shape, qtype)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype


def _converted(x: np.ndarray, qtype) -> np.ndarray:
    """One tensor's data as written in `qtype`: k-quants by `io/gguf_kquants.py`, other blocks by `gguf.quants`."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    x = np.asarray(x, np.float32)
    if qtype.name in BLOCK_BYTES:
        return quantize_rows(x, qtype.name)
    return x if qtype == Q.F32 else x.astype(np.float16) if qtype == Q.F16 else quants.quantize(x, qtype)


def save_gguf(path: str | Path, cfg: ModelConfig, params: dict, tokenizer: Tokenizer, kind: str = "f16",
              tensor=None, name: str = "jaxtune export") -> Path:
    """Write `params` (a plain model tree, or one with LoRA leaves and `tensor` = `methods.lora.merged_layer`) as a
    GGUF file of `kind` (f32, f16, bf16; q8_0: every matrix in 8-bit blocks of 32, vectors in float32; q4_0, q5_0,
    q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k: llama-quantize's file types, `gguf_mixture.py`)."""
    import gguf

    if kind not in KINDS:
        raise JaxtuneError(f"--type {kind!r}: expected one of {', '.join(KINDS)}")
    form = gguf_form(cfg)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [e for n, shape, _, produce in tensor_entries(params, cfg, np.float32, tensor=tensor, fused=True)
               for e in gguf_entries(n, tuple(shape), produce, form, cfg)]
    if form.untied_head and cfg.tie_word_embeddings:  # llama.cpp's loader requires the head: the table, again
        embed = next(e for e in entries if e[0] == "token_embd.weight")
        entries.append(("output.weight", *embed[1:]))
    s = cfg.rope_scaling
    if s is not None and s.kind == "llama3":
        entries.append((ROPE_FREQS, (cfg.head_dim // 2,), lambda: llama3_factors(
            cfg.rope_theta, cfg.head_dim, s.factor, s.low_freq_factor, s.high_freq_factor,
            s.original_max_position_embeddings).astype(np.float32)))
    if form.proportional and cfg.global_layers:  # the full layers' RoPE (default RoPE: every frequency rotated)
        entries.append((ROPE_FREQS, (cfg.global_head_dim // 2,), lambda: proportional_factors(
            cfg.global_head_dim, 1.0 if s is None else s.rotated_fraction)))
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    qtypes = _ggml_types(entries, kind, cfg, form)
    infos = [(gguf_name, _tensor_info(tuple(shape), qtypes[gguf_name])) for gguf_name, shape, _ in entries]
    with writing(path, sum(info[2] for _, info in infos)):
        writer = gguf.GGUFWriter(str(path), form.arch)
        writer.add_name(name)
        _add_config(writer, cfg, kind, form)
        _add_tokenizer(writer, tokenizer, cfg.vocab_size, form)
        for gguf_name, info in infos:
            writer.add_tensor_info(gguf_name, *info)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for gguf_name, _, produce in entries:
            x = produce()
            part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
            if form.permuted_qk and part in heads:
                x = permute_qk(x, heads[part])
            writer.write_tensor_data(_converted(x, qtypes[gguf_name]))
        writer.close()
    return path
