"""GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them, made from tiny transformers models (no network).

The tensors are quantised with the `gguf` package where it can (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1);
for the K-quants, which it only reads, each block is random bytes with its scale fields set small, so every
dequantised value is finite and below about 0.1. Either way the file, not the source model, is the reference: tests load
it with transformers (`from_pretrained(..., gguf_file=...)`) and with jaxtune and compare the two.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxtune.data.tokenizer import _bytes_to_unicode

HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
K_QUANTS = {Q.Q4_K: (144, ((0, 2), (2, 4))), Q.Q5_K: (176, ((0, 2), (2, 4))), Q.Q6_K: (210, ((208, 210),))}
# A byte-level vocabulary: three control tokens, the 256 bytes, and five merges.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_bytes_to_unicode(), *("".join(m) for m in MERGES)]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"
    return f"{HF_TO_GGUF[stem]}.{suffix}"


def permute(rows_x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a Llama query or key projection (its rotary kernel pairs adjacent rows), written
    out here as in its `convert_hf_to_gguf.py`, apart from jaxtune's own."""
    return rows_x.reshape(heads, 2, rows_x.shape[0] // heads // 2, *rows_x.shape[1:]).swapaxes(1, 2).reshape(
        rows_x.shape)


def random_k_blocks(rows: int, cols: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * block bytes] uint8 of random K-quant blocks with small scales."""
    size, scale_fields = K_QUANTS[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for a, b in scale_fields:
        blocks[..., a:b] = np.frombuffer(np.float16(2e-5 if kind == Q.Q6_K else 1e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: str | Path, model, kind: Q, tokenizer: str = "gpt2", seed: int = 0,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """`model` (a transformers Llama, Qwen2 or Qwen3) as a GGUF file: its 2-D weights in `kind`, norms and biases
    in F32, the config and a tokenizer (`TOKENS` byte-level, or `spm_tokens()` for "llama") as metadata; `extra`
    tensors written as they are."""
    cfg, arch = model.config, model.config.model_type
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(int(kind))
    if tokenizer == "gpt2":
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
        writer.add_token_merges([" ".join(m) for m in MERGES])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
    else:
        tokens, scores, types = spm_tokens()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name:
            continue
        w = tensor.detach().float().numpy()
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            w = permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w.astype(np.float32))
        elif kind in K_QUANTS:
            writer.add_tensor(gguf_name(name), random_k_blocks(*w.shape, kind, rng),
                              raw_dtype=kind)
        elif kind in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name(name), w.astype(np.float32 if kind == Q.F32 else np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, kind), raw_dtype=kind)
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor)
    return _written(writer, path)


def _written(writer, path: str | Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def spm_tokens() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary as llama.cpp stores one: <unk>, <s>, </s>, the 256 byte tokens, then pieces
    with scores (the longer, the higher), from which the merges are recovered."""
    pieces = ["▁", "t", "h", "e", "a", "n", "d", "▁t", "he", "▁the", "an", "▁a", "nd", "▁and", "▁an", "▁th"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))][::-1]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


# The 2025-26 families as llama.cpp's converter writes them (its `conversion/{llama,olmo,gpt_oss,llama4,deepseek}.py`):
# architecture, metadata beyond a Llama's, tensor names and the splitting of expert stacks, written out here apart
# from jaxtune's own writer.
FAMILY_ARCH = {"smollm3": "smollm3", "olmo2": "olmo2", "olmo3": "olmo2", "gpt_oss": "gpt-oss", "llama4": "llama4"}
FAMILY_NAMES = {"post_attention_layernorm": {"olmo2": "post_attention_norm", "olmo3": "post_attention_norm",
                                             "gpt_oss": "post_attention_norm"},
                "post_feedforward_layernorm": {"olmo2": "post_ffw_norm", "olmo3": "post_ffw_norm"}}
MOE_NAMES = {"router": "ffn_gate_inp", "shared_expert.gate_proj": "ffn_gate_shexp",
             "shared_expert.up_proj": "ffn_up_shexp", "shared_expert.down_proj": "ffn_down_shexp",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def family_tensor_name(hf_name: str, family: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if hf_name.endswith("self_attn.sinks"):
        return f"blk.{hf_name.split('.')[2]}.attn_sinks.weight"
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        if module in FAMILY_NAMES and family in FAMILY_NAMES[module]:
            return f"blk.{layer}.{FAMILY_NAMES[module][family]}.{suffix}"
        for prefix in ("mlp.", "feed_forward."):
            if module.startswith(prefix) and module[len(prefix):] in MOE_NAMES:
                return f"blk.{layer}.{MOE_NAMES[module[len(prefix):]]}.{suffix}"
    return gguf_name(hf_name)


def mxfp4_as_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' MXFP4 ([..., n/32, 16] bytes, value 2k in byte k's low nibble, 2k+1 in its high one; E8M0
    scales [..., n/32]) as GGML's blocks: the scale byte, then byte j holding value j (low) and j + 16 (high)."""
    values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(*blocks.shape[:-2], -1)


def write_family_gguf(path: str | Path, model, kind: Q = Q.F32, mxfp4: dict[str, tuple] | None = None) -> Path:
    """`model` (a transformers SmolLM3, OLMo 2 or 3, gpt-oss, Llama 4, DeepSeek-V3, Qwen3.5 or its MoE, Qwen3-Next) as
    llama.cpp's converter writes it; `mxfp4`: expert stack name -> (blocks, scales) in transformers' layout, written
    as GGML MXFP4 in its place."""
    cfg, family = model.config, model.config.model_type.removesuffix("_text")
    if family == "gemma4":
        return write_gemma4_gguf(path, model, kind)
    if family == "deepseek_v3":
        return write_deepseek_gguf(path, model, kind)
    if family in QWEN35_ARCH:
        return write_qwen35_gguf(path, model, kind)
    arch = FAMILY_ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(getattr(cfg, "intermediate_size_mlp", cfg.intermediate_size))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
        writer.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
    if rope.get("rope_type") == "llama3":  # as per-frequency divisors, its `generate_extra_tensors` loop
        factors = []
        for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
            wavelength, old = 2 * np.pi / freq, 8192  # the converter reads a top-level original length, or 8192
            if wavelength < old / rope["high_freq_factor"]:
                factors.append(1.0)
            elif wavelength > old / rope["low_freq_factor"]:
                factors.append(rope["factor"])
            else:
                low, high = rope["low_freq_factor"], rope["high_freq_factor"]
                smooth = (old / wavelength - low) / (high - low)
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        writer.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    experts = getattr(cfg, "num_local_experts", 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
    if family in ("olmo3", "gpt_oss"):
        writer.add_sliding_window(cfg.sliding_window)
    if family == "olmo3":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if family == "llama4":
        writer.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    writer.add_file_type(int(kind))
    _add_padded_tokens(writer, cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        if family == "smollm3" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if ".experts." in name:
            layer, stack = name.split(".")[2], name.rpartition(".")[2]
            if stack in ("gate_up_proj", "gate_up_proj_bias"):
                if stack == "gate_up_proj":
                    w = w.swapaxes(1, 2)  # [E, 2F, D]
                F = w.shape[1] // 2
                parts = (w[:, ::2], w[:, 1::2]) if family == "gpt_oss" else (w[:, :F], w[:, F:])
                if mxfp4 and name in mxfp4:
                    blocks, scales = mxfp4[name]
                    parts = (mxfp4_as_ggml(blocks[:, ::2], scales[:, ::2]),
                             mxfp4_as_ggml(blocks[:, 1::2], scales[:, 1::2]))
                suffix = "bias" if stack.endswith("bias") else "weight"
                for part, x in zip(("gate", "up"), parts):
                    _add(writer, f"blk.{layer}.ffn_{part}_exps.{suffix}", x, kind, raw=mxfp4 and name in mxfp4)
            else:
                suffix = "bias" if stack.endswith("bias") else "weight"
                x = w if suffix == "bias" else w.swapaxes(1, 2)
                if mxfp4 and name in mxfp4:
                    x = mxfp4_as_ggml(*mxfp4[name])
                _add(writer, f"blk.{layer}.ffn_down_exps.{suffix}", x, kind, raw=mxfp4 and name in mxfp4)
            continue
        _add(writer, family_tensor_name(name, family), w, kind)
    return _written(writer, path)


def _add(writer, name: str, w: np.ndarray, kind: Q, raw: bool = False) -> None:
    if raw:
        writer.add_tensor(name, np.ascontiguousarray(w), raw_dtype=Q.MXFP4)
    elif w.ndim == 1 or not name.endswith(".weight") or "norm" in name or "ffn_gate_inp" in name or kind == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    elif kind == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), kind), raw_dtype=kind)


def _add_padded_tokens(writer, vocab_size: int) -> None:
    """`TOKENS` padded with unused `[PAD{i}]` tokens to the model's embedding rows, as the converter pads them."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS + [f"[PAD{i}]" for i in range(len(TOKENS), vocab_size)])
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3) + [5] * (vocab_size - len(TOKENS)))
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_eos_token_id(2)


DEEPSEEK_NAMES = {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                  "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                  "self_attn.kv_a_layernorm": "attn_kv_a_norm", "mlp.gate": "ffn_gate_inp",
                  "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                  "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def write_deepseek_gguf(path: str | Path, model, kind: Q = Q.F32, split_kv_b: bool = True) -> Path:
    """A transformers DeepSeek-V3 as llama.cpp's converter writes it (`conversion/deepseek.py`, DeepseekV2Model, arch
    "deepseek2"), from a config.json that names its `scoring_func` as the released ones do (sigmoid: the gating
    function 2): one latent KV head; key and value lengths the latent's (R + rope, R) and the heads' in `*_mla`;
    `kv_b_proj` split into `attn_k_b` [H, R, nope] (each head's transposed) and `attn_v_b` [H, v, R]; experts
    stacked [E, out, in]; the routing bias as `exp_probs_b.bias`; YaRN's mscale_all_dim stored times 0.1; no row
    permuted. The multi-token-prediction layer is not written (transformers' model has none). Not `split_kv_b`: as
    converters before that split wrote it, `attn_kv_b` whole, the heads' key and value lengths, no `*_mla` keys."""
    cfg = model.config
    rope = cfg.rope_parameters
    H, R, nope, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(H)
    writer.add_head_count_kv(1 if split_kv_b else H)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(R)
    if split_kv_b:
        writer.add_key_length(R + cfg.qk_rope_head_dim)
        writer.add_value_length(R)
        writer.add_key_length_mla(nope + cfg.qk_rope_head_dim)
        writer.add_value_length_mla(v)
    else:
        writer.add_key_length(nope + cfg.qk_rope_head_dim)
        writer.add_value_length(v)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for name in ("beta_fast", "beta_slow"):
            if name in rope:
                writer.add_float32(f"deepseek2.rope.scaling.yarn_{name}", rope[name])
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_file_type(int(kind))
    _add_padded_tokens(writer, cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        stem, _, suffix = name.rpartition(".")
        if not stem.startswith("model.layers."):
            _add(writer, gguf_name(name), w, kind)
            continue
        _, _, layer, module = stem.split(".", 3)
        if module == "self_attn.kv_b_proj" and not split_kv_b:
            _add(writer, f"blk.{layer}.attn_kv_b.weight", w, kind)
        elif module == "self_attn.kv_b_proj":
            heads = w.reshape(H, nope + v, R)
            _add(writer, f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(heads[:, :nope].swapaxes(1, 2)), kind)
            _add(writer, f"blk.{layer}.attn_v_b.weight", heads[:, nope:], kind)
        elif suffix == "e_score_correction_bias":
            _add(writer, f"blk.{layer}.exp_probs_b.bias", w, kind)
        elif suffix == "gate_up_proj":  # [E, 2F, D]: gate's rows, then up's
            F = w.shape[1] // 2
            _add(writer, f"blk.{layer}.ffn_gate_exps.weight", w[:, :F], kind)
            _add(writer, f"blk.{layer}.ffn_up_exps.weight", w[:, F:], kind)
        elif suffix == "down_proj" and module == "mlp.experts":
            _add(writer, f"blk.{layer}.ffn_down_exps.weight", w, kind)
        else:
            _add(writer, f"blk.{layer}.{DEEPSEEK_NAMES.get(module) or HF_TO_GGUF[module]}.{suffix}", w, kind)
    return _written(writer, path)


QWEN35_ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
QWEN35_NAMES = {"post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_qkv": "attn_qkv",
                "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_ba": "ssm_ba",
                "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
                "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
                "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def write_qwen35_gguf(path: str | Path, model, kind: Q = Q.F32, older: bool = False) -> Path:
    """A transformers Qwen3.5, Qwen3.5-MoE or Qwen3-Next as llama.cpp's converter writes it (`conversion/qwen.py`,
    with --no-mtp): norms + 1 (Gated DeltaNet's own aside), A_log as `ssm_a` = -exp(A_log), dt_bias as
    `ssm_dt.bias`, conv1d squeezed; Qwen3-Next's `in_proj_qkvz` split key head by key head into `attn_qkv` and
    `attn_gate`; Qwen3.5's value heads reordered from grouped to tiled (its `_reorder_v_heads`); experts stacked
    [E, out, in]; `recurrent_layers` from layer_types, M-RoPE sections padded to 4 (default [11, 11, 10]).
    `older`: as other converters wrote it and llama.cpp still reads it: no `recurrent_layers` (the full-attention
    interval alone), Qwen3-Next's `in_proj_qkvz` whole as `ssm_in`, the shared expert's gate 1-D, and a
    multi-token-prediction block past the trunk (`nextn_predict_layers` 1: layer 3's tensors again, `nextn.*`)."""
    cfg, family = model.config, model.config.model_type.removesuffix("_text")
    arch = QWEN35_ARCH[family]
    nk, nv, hk, hv, D = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers + older)
    if older:
        writer.add_nextn_predict_layers(1)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(D)
    if getattr(cfg, "intermediate_size", None):
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":
        writer.add_rope_dimension_sections((list(rope.get("mrope_section") or [11, 11, 10]) + [0] * 4)[:4])
    if getattr(cfg, "num_experts", 0):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(hk)
    writer.add_ssm_group_count(nk)
    writer.add_ssm_time_step_rank(nv)
    writer.add_ssm_inner_size(hv * nv)
    if not older:
        writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
    writer.add_full_attention_interval(4)
    writer.add_file_type(int(kind))
    _add_padded_tokens(writer, cfg.vocab_size)

    def tiled(x: np.ndarray, dim: int, head_dim: int) -> np.ndarray:  # the converter's _reorder_v_heads
        if arch == "qwen3next" or nk == nv:
            return x
        s = list(x.shape)
        x = x.reshape(*s[:dim], nk, nv // nk, head_dim, *s[dim + 1:])
        return np.ascontiguousarray(np.swapaxes(x, dim, dim + 1).reshape(s))

    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        stem, _, suffix = name.rpartition(".")
        if not stem.startswith("model.layers."):
            _add(writer, gguf_name(name), w + 1 if name == "model.norm.weight" else w, kind)
            continue
        _, _, layer, module = stem.split(".", 3)
        blk = f"blk.{layer}."
        if name.endswith("norm.weight") and module != "linear_attn.norm":
            w = w + 1
        if suffix == "A_log":
            _add(writer, blk + "ssm_a", tiled(-np.exp(w), 0, 1), kind)
        elif suffix == "dt_bias":
            _add(writer, blk + "ssm_dt.bias", tiled(w, 0, 1), kind)
        elif module == "linear_attn.in_proj_qkvz" and older:
            _add(writer, blk + "ssm_in.weight", w, kind)
        elif module == "mlp.shared_expert_gate" and older:
            _add(writer, blk + "ffn_gate_inp_shexp.weight", w.reshape(-1), kind)
        elif module == "linear_attn.in_proj_qkvz":
            q, k, v, z = np.split(w.reshape(nk, -1, D), np.cumsum([hk, hk, nv // nk * hv]), 1)
            _add(writer, blk + "attn_qkv.weight", np.concatenate([x.reshape(-1, D) for x in (q, k, v)]), kind)
            _add(writer, blk + "attn_gate.weight", z.reshape(-1, D), kind)
        elif module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
            w = w.reshape(w.shape[0], -1)  # conv1d [C, 1, K] squeezed
            w = np.concatenate([w[:2 * nk * hk], tiled(w[2 * nk * hk:], 0, hv)])
            _add(writer, blk + QWEN35_NAMES[module] + ".weight", w, kind)
        elif module in ("linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a"):
            _add(writer, blk + QWEN35_NAMES[module] + ".weight", tiled(w, 0, hv if module.endswith("z") else 1), kind)
        elif module == "linear_attn.out_proj":
            _add(writer, blk + "ssm_out.weight", tiled(w, 1, hv), kind)
        elif suffix == "gate_up_proj":  # [E, 2F, D]: gate's rows, then up's
            F = w.shape[1] // 2
            _add(writer, blk + "ffn_gate_exps.weight", w[:, :F], kind)
            _add(writer, blk + "ffn_up_exps.weight", w[:, F:], kind)
        elif suffix == "down_proj" and module == "mlp.experts":
            _add(writer, blk + "ffn_down_exps.weight", w, kind)
        else:
            _add(writer, f"{blk}{QWEN35_NAMES.get(module) or HF_TO_GGUF[module]}.{suffix}", w, kind)
    if older:  # the MTP block: a full-attention layer (layer 3's tensors) and its own embedding norms and projection
        last, mtp = f"blk.{cfg.num_hidden_layers - 1}.", f"blk.{cfg.num_hidden_layers}."
        rng = np.random.default_rng(0)
        for name, x in (("nextn.eh_proj.weight", rng.normal(0, 0.1, (D, 2 * D))), ("nextn.enorm.weight", np.ones(D)),
                        ("nextn.hnorm.weight", np.ones(D)), ("nextn.shared_head_norm.weight", np.ones(D))):
            _add(writer, mtp + name, x.astype(np.float32), kind)
        for name in [n for n in writer.tensors[0] if n.startswith(last)]:
            info = writer.tensors[0][name]
            writer.add_tensor(mtp + name[len(last):], np.asarray(info.tensor))
    return _written(writer, path)


# Gemma 4's kind of vocabulary (BPE over UTF-8 with byte fallback, spaces as U+2581), as many tokens as `TOKENS`:
# pad, eos, bos and unk (Gemma's ids), the 256 byte tokens, four pieces and one merge.
GEMMA4_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "t", "e", "▁t"]
GEMMA4_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                "pre_feedforward_layernorm_2": "pre_ffw_norm_2", "post_feedforward_layernorm_1": "post_ffw_norm_1",
                "post_feedforward_layernorm_2": "post_ffw_norm_2", "per_layer_input_gate": "inp_gate",
                "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
                "router.proj": "ffn_gate_inp", "experts.gate_up_proj": "ffn_gate_up_exps",
                "experts.down_proj": "ffn_down_exps", "layer_scalar": "layer_output_scale"}
GEMMA4_TOP = {"model.embed_tokens_per_layer": "per_layer_token_embd",
              "model.per_layer_model_projection": "per_layer_model_proj",
              "model.per_layer_projection_norm": "per_layer_proj_norm"}


def write_gemma4_gguf(path: str | Path, model, kind: Q = Q.F32) -> Path:
    """A transformers Gemma 4 as llama.cpp's converter writes it (`conversion/gemma.py`, Gemma4Model, arch "gemma4"),
    from the config.json `save_pretrained` writes (the full layers' head width and KV heads in `per_layer_config`):
    the full layers' head width as `key_length`, the sliding ones' as `key_length_swa` (RoPE dimensions and bases
    alike), KV heads an array a layer where the full layers' count is named, MLP widths one where
    `use_double_wide_mlp`, the sliding pattern as booleans, no soft cap key where there is none; norms as they are,
    `router.scale` as `ffn_gate_inp.scale`, `per_expert_scale` as `ffn_down_exps.scale`, the expert stacks whole
    (`ffn_gate_up_exps` [E, 2F, D]), `layer_scalar` as `layer_output_scale`, and proportional RoPE as `rope_freqs`
    (1 for each rotated frequency, then 1e30). The vocabulary is `GEMMA4_TOKENS` (so the embedding keeps its rows)."""
    hf = json.loads(model.config.to_json_string())
    layers, per_layer = hf["num_hidden_layers"], hf.get("per_layer_config") or {}
    sliding = [t == "sliding_attention" for t in hf["layer_types"]]

    def full_layers(name: str):  # the converter's: the first full layer's entry that names it
        return hf.get({"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}[name]) or \
            next((c[name] for i, c in per_layer.items() if not sliding[int(i)] and name in c), None)

    head_full, kv_full, shared = full_layers("head_dim"), full_layers("num_key_value_heads"), hf["num_kv_shared_layers"]
    rope = hf["rope_parameters"]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(layers)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    width = hf["intermediate_size"]
    writer.add_feed_forward_length([width if i < layers - shared else 2 * width for i in range(layers)]
                                   if hf.get("use_double_wide_mlp") else width)
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"] if kv_full is None else
                             [hf["num_key_value_heads"] if s else kv_full for s in sliding])
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(hf["head_dim"])
    writer.add_value_length_swa(hf["head_dim"])
    writer.add_rope_dimension_count(head_full)
    writer.add_rope_dimension_count_swa(int(hf["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if hf.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hf.get("hidden_size_per_layer_input") or 0)
    for value, add in ((hf.get("num_experts"), writer.add_expert_count),
                       (hf.get("top_k_experts"), writer.add_expert_used_count),
                       (hf.get("moe_intermediate_size"), writer.add_expert_feed_forward_length)):
        if value is not None:
            add(value)
    writer.add_file_type(int(kind))
    _add_gemma4_tokens(writer)
    rotated = int(head_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    _add(writer, "rope_freqs.weight", np.asarray([1.0] * rotated + [1e30] * (head_full // 2 - rotated), np.float32),
         kind)
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        stem, _, suffix = name.rpartition(".")
        if stem in GEMMA4_TOP:
            _add(writer, f"{GEMMA4_TOP[stem]}.{suffix}", w, kind)
            continue
        if not stem.startswith("model.layers."):
            _add(writer, gguf_name(name), w, kind)
            continue
        layer, module = name.split(".", 3)[2:]
        blk = f"blk.{layer}."
        if module == "router.scale":
            _add(writer, blk + "ffn_gate_inp.scale", w, kind)
        elif module == "router.per_expert_scale":
            _add(writer, blk + "ffn_down_exps.scale", w, kind)
        elif module in GEMMA4_NAMES:  # a bare tensor: the converter names it `.weight`
            _add(writer, blk + GEMMA4_NAMES[module] + ".weight", w, kind)
        else:
            module = stem.split(".", 3)[3]
            _add(writer, f"{blk}{GEMMA4_NAMES.get(module) or HF_TO_GGUF[module]}.{suffix}", w, kind)
    return _written(writer, path)


def _add_gemma4_tokens(writer) -> None:
    """`GEMMA4_TOKENS` as the converter's `Gemma4Model.set_vocab` writes a vocabulary (`LlamaHfVocab`, SpecialVocab):
    model "gemma4", scores -1000, byte tokens BYTE, the specials CONTROL, the merges, the special ids, no space
    prefix, BOS added; no `tokenizer.ggml.pre`."""
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(GEMMA4_TOKENS)
    writer.add_token_scores([-1000.0] * len(GEMMA4_TOKENS))
    writer.add_token_types([3] * 4 + [6] * 256 + [1] * (len(GEMMA4_TOKENS) - 260))
    writer.add_token_merges(["▁ t"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
