"""GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them, made from tiny transformers models (no network).

The tensors are quantised with the `gguf` package where it can (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1);
for the K-quants, which it only reads, each block is random bytes with its scale fields set small, so every
dequantised value is finite and below about 0.1. Either way the file, not the source model, is the reference: tests load
it with transformers (`from_pretrained(..., gguf_file=...)`) and with jaxtune and compare the two.
"""

from __future__ import annotations

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
