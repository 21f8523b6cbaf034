"""Tiny random transformers models (the reference stack: torch and transformers), saved as Hugging Face directories
without network. Imported by the tests that use them, which are marked `reference`; the `hf_model_dir` fixture
(tests/conftest.py) imports it when first used."""

from __future__ import annotations

import copy

import numpy as np
import torch
import transformers

# Weights scaled so activations and logits are O(1): parity at 1e-4 then means something.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}}),
    "llama_tied_bias_linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, "head_dim": 32,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 5}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen2_sliding": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {
        "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {  # head_dim 32 where hidden / heads is 16
        "tie_word_embeddings": True, "head_dim": 32, "use_sliding_window": True, "sliding_window": 4,
        "max_window_layers": 2}),
    # Soft caps low enough to act on O(1) scores and logits; 1 / sqrt(24) in place of 1 / sqrt(head_dim = 32);
    # layers sliding, full, sliding (window 4 < the batch's 12 tokens).
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 4, "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 2.0}),
    # Full layers with RoPE base 1e6 scaled linearly by 4, sliding ones (window 4) with base 1e4.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # Fused qkv_proj and gate_up_proj, RoPE on 3/4 of each head (Phi-4-mini's), longrope (its short factors up to
    # 64 positions, its long ones past them), one window (6) for every layer.
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {
        "head_dim": 16, "partial_rotary_factor": 0.75, "sliding_window": 6, "original_max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]}}),
    # Mixtures of experts, top-2 routing: Mixtral's 4 experts (window 6); Qwen2-MoE's 4 narrower experts, their top 2
    # weights not renormalised, and a shared expert; Qwen3-MoE's 6 with renormalised weights and query/key norms.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {
        "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, {
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 4,
        "num_experts_per_tok": 2}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 6, "num_experts_per_tok": 2,
        "norm_topk_prob": True}),
    # SmolLM3: layer 1 NoPE and sliding (window 4), layers 0 and 2 rotating over full attention.
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, {
        "no_rope_layers": [1, 0, 1], "use_sliding_window": True, "sliding_window": 4, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2}),
    # OLMo 2: norms after each sub-layer, query/key norms over the whole projection; OLMo 3 adds sliding layers
    # (window 4) with their own unscaled RoPE, full layers with YaRN (past 16 positions, factor 4).
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {"pad_token_id": 0, "eos_token_id": 2}),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, {"pad_token_id": 0, "eos_token_id": 2,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500_000.0,
                                               "original_max_position_embeddings": 16},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # gpt-oss: 4 experts (top 2) with biases and the clamped SwiGLU, attention sinks and biases, layers sliding
    # (window 4), full, sliding; YaRN (factor 4 past 16 positions, the ramp's ends not rounded).
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, {
        "intermediate_size": 32, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150_000.0},
        "pad_token_id": 0, "eos_token_id": 2, "attn_implementation": "eager"}),
    # Llama 4 (text, Scout's shape): 4 experts (top 1) scaling their inputs, a shared expert; layers 0 and 1 rotate
    # (interleaved pairs, L2-normed) within chunks of 4, layer 2 is NoPE and global with temperature (floor 4).
    # Qwen3.5 (text): Gated DeltaNet layers 0 and 2 (2 key heads of 8 serving 4 value heads of 16, 4 taps), gated
    # attention layers 1 and 3 with RoPE on a quarter of each head (4 of 16); two periods of the layer scan.
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {
        "num_hidden_layers": 4, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2, "pad_token_id": 0, "eos_token_id": 2}),
    # Qwen3.5-MoE: the same layers, each MLP 4 experts (top 2, renormalised) and a gated shared expert.
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, {
        "num_hidden_layers": 4, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["linear_attention", "full_attention"] * 2, "pad_token_id": 0, "eos_token_id": 2}),
    # Qwen3-Next: Qwen3.5-MoE's layers with Gated DeltaNet's projections fused key head by key head.
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, {
        "num_hidden_layers": 4, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["linear_attention", "full_attention"] * 2, "pad_token_id": 0, "eos_token_id": 2}),
    # Qwen3-Next with dense MLP layers (mlp_only_layers, intermediate_size 112) among its mixtures: layers of all
    # four kinds (linear/attention x dense/mixture)
    "qwen3_next_dense": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, {
        "num_hidden_layers": 4, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0, 3],
        "layer_types": ["linear_attention", "full_attention"] * 2, "pad_token_id": 0, "eos_token_id": 2}),
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, {
        "intermediate_size": 32, "intermediate_size_mlp": 64, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 1, "no_rope_layers": [1, 1, 0], "attention_chunk_size": 4, "floor_scale": 4,
        "attn_scale": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "attn_implementation": "eager"}),
    # Llama 4 Maverick's shape: dense MLP layers (0, 2) between the mixtures (1, 3)
    "llama4_maverick": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, {
        "num_hidden_layers": 4, "intermediate_size": 32, "intermediate_size_mlp": 64, "head_dim": 16,
        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "attention_chunk_size": 4,
        "floor_scale": 4, "attn_scale": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "attn_implementation": "eager"}),
    # DeepSeek-V3: latent attention (queries through a rank-24 latent, keys and values from a rank-16 one; 16 + 8
    # rotated dimensions a query and key, 12 a value), YaRN with its softmax term; layer 0 dense, layers 1 and 2
    # mixtures of 8 experts in 4 groups (top 2 groups, top 2 experts) with a shared expert and a choice bias.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, {
        "moe_intermediate_size": 32, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "qk_nope_head_dim": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10_000.0},
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Gemma 4 as E2B/E4B and 26B-A4B make it, every part at once: sliding (window 4) and full layers, the full ones
    # 32 wide with one key/value head and values from the keys' projection (proportional RoPE on a quarter), the
    # last three layers sharing layers 1 and 2's keys and values with double-wide MLPs, per-layer inputs (16 a
    # layer), a mixture of 4 experts (top 2) beside every MLP, a final soft cap.
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM, {
        "num_hidden_layers": 6, "intermediate_size": 48, "head_dim": 16, "global_head_dim": 32,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 3,
        "use_double_wide_mlp": True, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 96,
        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24,
        "final_logit_softcapping": 3.0, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
        "attn_implementation": "eager"}),
    # Gemma 4 as 31B makes it: no per-layer inputs, no sharing, values of their own on the full (32-wide) layers
    "gemma4_dense": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM, {
        "head_dim": 16, "global_head_dim": 32, "sliding_window": 4, "hidden_size_per_layer_input": 0,
        "layer_types": ["sliding_attention", "full_attention", "full_attention"], "pad_token_id": 0,
        "bos_token_id": 2, "eos_token_id": 1, "attn_implementation": "eager"}),
}


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1) (Gemma's and Qwen3.5's weights N(0, 0.1): they scale
    by 1 + weight, but for Qwen3.5's gated norm), biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    unit = 0.0 if type(model).__name__.startswith(("Gemma", "Qwen3_5", "Qwen3Next")) else 1.0  # Qwen3_5Moe too
    unit = 1.0 if type(model).__name__.startswith("Gemma4") else unit  # its norms scale by the weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or name.endswith("scale"):  # Gemma 4's router's scale and per-expert scale too
                p.copy_((1.0 if "linear_attn.norm" in name else unit) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():  # DeepSeek's routing bias, which only changes the experts chosen
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
            if name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))
    return model.eval()


def make_hf_model(arch: str, directory, seed: int = 0, **overrides):
    """A random transformers model of `arch`, saved with save_pretrained into `directory`; returns the model."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**copy.deepcopy({**TINY, **extra, **overrides}))  # configs edit their rope dicts in place
    torch.manual_seed(seed)
    model = randomize(model_cls(config), seed)
    model.save_pretrained(directory)
    return model
