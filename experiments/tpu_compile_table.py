"""The planner against the TPU compiler: real model shapes, TPU slices, on this host (no TPU, no weights).

    python experiments/tpu_compile_table.py              # every row not yet in the results file (~40 min, 2 cores)
    python experiments/tpu_compile_table.py --only 8b    # the rows whose label contains "8b"
    python experiments/tpu_compile_table.py --table      # the Markdown table of the results file
    python experiments/tpu_compile_table.py --replan     # the planner's columns again (no compiling), then the table

Each row is a model from its published config.json (Llama-3.2-1B and 3B, Llama-3.1-8B and 70B, Qwen3-8B, Gemma-2-9B,
Mixtral-8x7B, Qwen3-30B-A3B; Qwen2.5-VL-7B and Gemma-3-27B with images, their preprocessor_config.json beside) with
a method, objective, context, slice, mesh and remat policy, compiled by libtpu for the slice's topology
(`jaxtune.planner.confirm_plan`, in a subprocess a row). Recorded: the planner's bytes per device
(`Estimate.compiled_bytes`, no runtime reserve) against the compiler's (arguments + temporaries + outputs - aliased),
the planner's FLOPs (`planner.timing.step_time`) against the program's (every matmul of the traced step, loops by
their trip counts: `planner.program_flops`) and XLA's `cost_analysis` (which counts a loop body once), the compile's
seconds on this host, and a step time and MFU *modelled* from the program's FLOPs at the chip's peak (never a
measurement). Results: experiments/results/tpu_compile_table.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # the TPU compiler only: no TPU backend is looked for on this host
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

RESULTS = Path(os.environ.get("TPU_TABLE", Path(__file__).parent / "results" / "tpu_compile_table.json"))
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu", "num_key_value_heads": 8}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0, "max_position_embeddings": 40960, "hidden_act": "silu", "head_dim": 128,
         "tie_word_embeddings": False}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
           "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 131072, "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "router_aux_loss_coef": 0.9, "output_router_logits": False,
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
           "rope_theta": 150000.0}
GEMMA4 = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144,
          "head_dim": 256, "global_head_dim": 512, "sliding_window": 1024, "final_logit_softcapping": 30.0,
          "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
          "tie_word_embeddings": True}
# the published config.json of each model, the fields jaxtune reads
MODELS = {
    "llama-3.2-1b": {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}},
    "llama-3.2-3b": {**LLAMA, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "head_dim": 128, "tie_word_embeddings": True,
                     "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}},
    "llama-3.1-8b": {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "head_dim": 128, "tie_word_embeddings": False,
                     "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}},
    "llama-3.1-70b": {**LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "head_dim": 128, "tie_word_embeddings": False,
                      "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    "gemma-2-9b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
                   "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                     "rope_theta": 1000000.0, "max_position_embeddings": 32768, "hidden_act": "silu",
                     "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
                     "sliding_window": None},
    "qwen3-30b-a3b": {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": []},
    # issue 50: the families of 2025-26
    "gpt-oss-20b": GPT_OSS,
    "gpt-oss-120b": {**GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18},
    "llama-4-scout": {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": 202048,
                      "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                      "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                      "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                      "rms_norm_eps": 1e-5, "max_position_embeddings": 10485760, "hidden_act": "silu",
                      "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 16.0},
                      "attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": True,
                      "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                      "tie_word_embeddings": False},
    # its text model as released: 128 experts routed top-1 in every other layer, the rest dense (16,384 wide)
    "llama-4-maverick": {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": 202048,
                         "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                         "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
                         "head_dim": 128, "num_local_experts": 128, "num_experts_per_tok": 1,
                         "interleave_moe_layer_step": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
                         "hidden_act": "silu", "rope_theta": 500000.0, "rope_scaling": None,
                         "attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": False,
                         "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                         "tie_word_embeddings": False},
    "smollm3-3b": {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "vocab_size": 128256,
                   "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                   "rope_theta": 5000000.0, "max_position_embeddings": 65536, "hidden_act": "silu",
                   "no_rope_layer_interval": 4, "use_sliding_window": False, "tie_word_embeddings": True},
    "olmo-3-7b": {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "vocab_size": 100278,
                  "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 65536, "hidden_act": "silu", "sliding_window": 4096,
                  "tie_word_embeddings": False,
                  "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 500000.0,
                                                         "original_max_position_embeddings": 8192,
                                                         "attention_factor": 1.2079441541679836,
                                                         "beta_fast": 32.0, "beta_slow": 1.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}},
    # as released: a vision-language checkpoint whose text model jaxtune reads (48 Gated DeltaNet + 16 attention)
    "qwen3.5-27b": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                    "tie_word_embeddings": False,
                    "text_config": {"vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
                                    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                                    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                                    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
                                    "hidden_act": "silu", "max_position_embeddings": 262144,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                        "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                        "mrope_section": [11, 11, 10]}}},
    # as released (its FP8 quantization_config aside): latent attention, 3 dense layers, then 58 mixtures of 256
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
                    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                          "mscale_all_dim": 1.0,
                                                          "original_max_position_embeddings": 4096, "type": "yarn"},
                    "tie_word_embeddings": False, "attention_bias": False},
    # Gemma 4 (text): E2B's per-layer inputs, 20 KV-sharing layers with double-wide MLPs, full layers 512 wide; the
    # 26B-A4B's 128 experts (top 8) beside every MLP and 31B's dense layers, full layers' values from their keys.
    # Shapes as their config.json files hold them; the 26B-A4B's 30 and the 31B's 60 layers are the counts whose
    # parameters make 25.1B (3.7B active) and 30.7B
    "gemma-4-e2b": {**GEMMA4, "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
                    "num_attention_heads": 8, "num_key_value_heads": 1, "sliding_window": 512,
                    "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 256,
                    "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                    for i in range(35)]},
    "gemma-4-26b-a4b": {**GEMMA4, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
                        "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
                        "moe_intermediate_size": 704, "hidden_size_per_layer_input": 0},
    "gemma-4-31b": {**GEMMA4, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
                    "attention_k_eq_v": True, "hidden_size_per_layer_input": 0},
    # issue 52: vision-language checkpoints as released (config.json), their image processors below
    "qwen2.5-vl-7b": {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                      "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                      "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                      "rope_theta": 1000000.0, "max_position_embeddings": 128000, "max_window_layers": 28,
                      "sliding_window": 32768, "use_sliding_window": False, "hidden_act": "silu",
                      "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
                      "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
                      "image_token_id": 151655, "video_token_id": 151656,
                      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                      "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                                        "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                                        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                        "spatial_patch_size": 14, "window_size": 112,
                                        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                                        "temporal_patch_size": 2}},
    "gemma-3-27b-it": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                       "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
                       "image_token_index": 262144, "mm_tokens_per_image": 256,
                       "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                                       "model_type": "gemma3_text", "num_attention_heads": 32,
                                       "num_hidden_layers": 62, "num_key_value_heads": 16,
                                       "query_pre_attn_scalar": 168, "sliding_window": 1024,
                                       "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                       "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                         "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                         "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
}
# their preprocessor_config.json as released, but Qwen's max_pixels: the 1,280 merged tokens (5,120 patches) an
# image its model card suggests, not the released 12,845,056 pixels (65,536 patches); Gemma's 896 px, no pan-and-scan
PREPROCESSORS = {
    "qwen2.5-vl-7b": {"min_pixels": 3136, "max_pixels": 1280 * 28 * 28, "patch_size": 14, "temporal_patch_size": 2,
                      "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711],
                      "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"},
    "gemma-3-27b-it": {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
                       "image_seq_length": 256, "processor_class": "Gemma3Processor", "resample": 2,
                       "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}},
}

# (model, method, objective, tokens a row, batch (examples over all devices), target, mesh, remat); an objective
# "sft+N images": SFT on a vision-language model, N pixel arrays a row (`data.max_images_per_row`)
ROWS = [
    ("llama-3.2-1b", "full", "sft", 2048, 8, "v5e-8", "fsdp=8", "none"),
    ("llama-3.2-1b", "lora", "sft", 2048, 8, "v5e-8", "fsdp=8", "full"),
    ("llama-3.2-1b", "lora", "sft", 8192, 8, "v5e-8", "fsdp=8", "none"),
    ("llama-3.2-1b", "qlora", "sft", 4096, 8, "v5e-8", "fsdp=8", "full"),
    ("llama-3.2-1b", "dora", "sft", 2048, 8, "v5e-8", "fsdp=8", "save_matmuls"),
    ("llama-3.2-1b", "lora", "dpo", 2048, 4, "v5e-8", "fsdp=8", "full"),
    ("llama-3.2-1b", "lora", "grpo", 1024, 2, "v5e-8", "fsdp=8", "full"),
    ("llama-3.2-3b", "full", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("llama-3.2-3b", "lora", "sft", 8192, 8, "v6e-8", "fsdp=8", "full"),
    ("llama-3.2-3b", "lora", "sft", 2048, 8, "v5e-8", "fsdp=4,tensor=2", "save_matmuls"),
    ("llama-3.2-3b", "qlora", "dpo", 4096, 4, "v5e-8", "fsdp=8", "full"),
    ("llama-3.2-3b", "lora", "sft", 32768, 8, "v6e-8", "fsdp=8", "full"),
    ("llama-3.2-3b", "full", "dpo", 2048, 16, "v5p-64", "fsdp=32", "full"),
    ("llama-3.1-8b", "lora", "sft", 2048, 8, "v5e-8", "fsdp=8", "full"),
    ("llama-3.1-8b", "full", "sft", 4096, 32, "v5p-64", "fsdp=32", "full"),
    ("llama-3.1-8b", "qlora", "sft", 8192, 8, "v5e-8", "fsdp=8", "full"),
    ("llama-3.1-8b", "dora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("llama-3.1-8b", "lora", "dpo", 4096, 8, "v6e-8", "fsdp=4,tensor=2", "full"),
    ("llama-3.1-8b", "lora", "grpo", 2048, 2, "v6e-8", "fsdp=8", "full"),
    ("llama-3.1-8b", "lora", "sft", 16384, 32, "v5p-64", "fsdp=32", "full"),
    ("llama-3.1-8b", "full", "sft", 2048, 64, "v6e-64", "fsdp=64", "save_matmuls"),
    ("llama-3.1-70b", "lora", "sft", 4096, 64, "v5p-128", "fsdp=64", "full"),
    ("llama-3.1-70b", "qlora", "sft", 8192, 32, "v5p-64", "fsdp=32", "full"),
    ("llama-3.1-70b", "full", "sft", 2048, 64, "v5p-128", "fsdp=64", "full"),
    ("llama-3.1-70b", "lora", "sft", 8192, 16, "v6e-64", "fsdp=16,tensor=4", "full"),
    ("qwen3-8b", "lora", "sft", 4096, 8, "v5e-8", "fsdp=8", "full"),
    ("qwen3-8b", "full", "sft", 8192, 32, "v5p-64", "fsdp=32", "full"),
    ("qwen3-8b", "lora", "dpo", 2048, 4, "v6e-8", "fsdp=8", "save_matmuls"),
    ("qwen3-8b", "qlora", "sft", 32768, 8, "v6e-8", "fsdp=8", "full"),
    ("gemma-2-9b", "lora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("gemma-2-9b", "full", "sft", 8192, 32, "v5p-64", "fsdp=32", "full"),
    ("gemma-2-9b", "qlora", "sft", 2048, 8, "v5e-8", "fsdp=8", "full"),
    ("mixtral-8x7b", "lora", "sft", 4096, 32, "v5p-64", "fsdp=8,expert=4", "full"),
    ("mixtral-8x7b", "full", "sft", 2048, 64, "v5p-128", "fsdp=16,expert=4", "full"),
    ("mixtral-8x7b", "qlora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("mixtral-8x7b", "lora", "sft", 4096, 16, "v5p-64", "fsdp=4,expert=4,tensor=2", "full"),
    ("qwen3-30b-a3b", "lora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("qwen3-30b-a3b", "full", "sft", 4096, 32, "v5p-64", "fsdp=4,expert=8", "full"),
    ("qwen3-30b-a3b", "lora", "sft", 2048, 64, "v6e-64", "fsdp=8,expert=8", "save_matmuls"),
    # context parallelism (issue 31): one long row split over a context axis, ring attention
    ("llama-3.1-8b", "lora", "sft", 131072, 1, "v5p-16", "fsdp=1,context=8", "full"),
    ("llama-3.1-8b", "lora", "sft", 1048576, 1, "v5p-128", "fsdp=1,context=64", "full"),
    # issue 50: DeepSeek-V3's LoRA with 4 and 8 devices an expert group (16: below), which set `EXPERT_STREAMS`
    ("deepseek-v3", "lora", "sft", 4096, 256, "v5p-512", "fsdp=64,expert=4", "full"),
    ("deepseek-v3", "lora", "sft", 4096, 256, "v5p-512", "fsdp=32,expert=8", "full"),
    # held out: compiled after the TPU rules were calibrated on the rows above
    ("llama-3.2-1b", "full", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("llama-3.2-3b", "dora", "sft", 4096, 8, "v6e-8", "fsdp=4,tensor=2", "full"),
    ("llama-3.1-8b", "qlora", "sft", 4096, 16, "v5e-8", "fsdp=8", "save_matmuls"),
    ("qwen3-8b", "lora", "sft", 16384, 32, "v5p-64", "fsdp=32", "full"),
    ("gemma-2-9b", "lora", "dpo", 2048, 8, "v6e-8", "fsdp=8", "full"),
    ("qwen3-30b-a3b", "lora", "sft", 4096, 32, "v5p-64", "fsdp=8,expert=4", "full"),
    # issue 50: the families of 2025-26 (compiled after the rules above were set; not calibrated on)
    ("gpt-oss-20b", "lora", "sft", 4096, 8, "v5e-8", "fsdp=8", "full"),
    ("gpt-oss-20b", "full", "sft", 4096, 32, "v5p-64", "fsdp=8,expert=4", "full"),
    ("gpt-oss-120b", "lora", "sft", 4096, 32, "v5p-64", "fsdp=8,expert=4", "full"),
    ("llama-4-scout", "lora", "sft", 8192, 32, "v5p-64", "fsdp=8,expert=4", "full"),
    ("smollm3-3b", "lora", "sft", 8192, 8, "v6e-8", "fsdp=8", "full"),
    ("olmo-3-7b", "lora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("qwen3.5-27b", "lora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    ("deepseek-v3", "lora", "sft", 4096, 256, "v5p-512", "fsdp=16,expert=16", "full"),
    ("deepseek-v3", "full", "sft", 2048, 256, "v5p-512", "fsdp=32,expert=8", "full"),
    ("gemma-4-e2b", "lora", "sft", 8192, 8, "v6e-8", "fsdp=8", "full"),
    ("gemma-4-26b-a4b", "lora", "sft", 4096, 32, "v5p-64", "fsdp=8,expert=4", "full"),
    ("gemma-4-31b", "lora", "sft", 4096, 8, "v6e-8", "fsdp=8", "full"),
    # predicted before it was compiled, after the top-1 rule was set on Scout's row
    ("llama-4-maverick", "lora", "sft", 8192, 64, "v5p-128", "fsdp=8,expert=8", "full"),
    # issue 51: GRPO with 4,096-token rollouts (512 of prompt), groups of 4, predicted before compiling
    ("llama-3.1-8b", "lora", "grpo@4096", 4608, 16, "v5p-64", "fsdp=32", "full"),
    ("llama-3.1-8b", "lora", "grpo@4096", 4608, 2, "v6e-8", "fsdp=8", "full"),
    # issue 52: SFT with images, the frozen tower inside the step (Qwen: 1,280 tokens an image; Gemma: 256)
    ("qwen2.5-vl-7b", "lora", "sft+2 images", 4096, 8, "v5e-8", "fsdp=8", "full"),
    ("qwen2.5-vl-7b", "lora", "sft+2 images", 4096, 16, "v6e-8", "fsdp=8", "full"),
    ("gemma-3-27b-it", "lora", "sft+2 images", 2048, 8, "v5e-8", "fsdp=8", "full"),
    ("gemma-3-27b-it", "lora", "sft+2 images", 4096, 8, "v6e-8", "fsdp=8", "full"),
    # the same text models without images: what the image side adds, in the compiler's bytes
    ("qwen2.5-vl-7b", "lora", "sft", 4096, 8, "v5e-8", "fsdp=8", "full"),
    ("gemma-3-27b-it", "lora", "sft", 2048, 8, "v5e-8", "fsdp=8", "full"),
]
HELD_OUT = 27  # the last rows: compiled after the TPU rules were calibrated (issue 50's families among them)

# Issue 53: remat "offload" (each layer's input in pinned host memory inside the step) beside the same step under
# "full" (v5e-8's is above): the compiler's device bytes against the planner's, its host bytes against the planner's
# offloaded layer inputs. Held out: compiled after the planner's offload rule was written.
OFFLOAD_ROWS = [
    ("llama-3.1-8b", "qlora", "sft", 8192, 8, "v5e-8", "fsdp=8", "offload"),
    ("llama-3.1-8b", "qlora", "sft", 32768, 4, "v5p-8", "fsdp=4", "full"),
    ("llama-3.1-8b", "qlora", "sft", 32768, 4, "v5p-8", "fsdp=4", "offload"),
]
ROWS += OFFLOAD_ROWS
HELD_OUT += len(OFFLOAD_ROWS)
GRPO_TOKENS = 256  # a rollout's new tokens


def label(row) -> str:
    model, method, objective, seq, batch, target, mesh, remat = row
    return f"{model} {method} {objective} {batch}x{seq} {target} {mesh} remat={remat}"


def model_and_plan(row):
    """(model config, plan, device) of a row."""
    from jaxtune.config import ForwardOptions
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.models.hf_config import config_from_hf
    from jaxtune.planner import get_device
    from jaxtune.planner.command import parse_mesh

    model, method, objective, seq, batch, target, mesh, remat = row
    objective, _, rollout = objective.partition("@")  # "grpo@4096": a rollout of 4,096 new tokens
    objective, _, images = objective.partition("+")  # "sft+2 images": 2 pixel arrays a row
    kind = "lora" if method == "dora" else method
    targets = ("all-linear",) if kind in ("lora", "qlora") else ()
    options = dict(rank=16, alpha=32.0, target_modules=targets, dora=method == "dora") if targets else {}
    plan = TrainPlan(method_config(kind, **options), batch,
                     seq, 1, param_dtype="bfloat16", forward=ForwardOptions(compute_dtype="bfloat16", remat=remat),
                     mesh=parse_mesh(mesh), objective=objective,
                     generate_tokens=int(rollout or GRPO_TOKENS) if objective == "grpo" else 0,
                     images=image_side_of(model, int(images.split()[0])) if images else None)
    return config_from_hf(MODELS[model], model), plan, get_device(target)


def image_side_of(model: str, max_images: int):
    """The `ImageSide` a run of `model` holds: its family unit's reading of its config.json and
    preprocessor_config.json, written to a directory without weights."""
    from jaxtune.models.vision.families import image_side

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(MODELS[model]))
        (Path(directory) / "preprocessor_config.json").write_text(json.dumps(PREPROCESSORS[model]))
        return image_side(directory, max_images)


def planner_columns(est) -> dict:
    from jaxtune.planner.timing import step_time

    t = step_time(est)  # its FLOPs against the step's program: GRPO's rollout is a program of its own
    return {"planner_bytes": est.compiled_bytes, "planner_host_bytes": est.offloaded_activations_bytes,
            "planner_fits": est.fits, "usable_bytes": est.device.usable_bytes,
            "reserve_bytes": est.reserve_bytes, "planner_flops": (t.flops - t.rollout_flops) / est.device.count}


def replan(result: dict, row) -> dict:
    """`result` with the planner's columns of today's planner and the program's FLOPs counted again from the traced
    step (the compiler's bytes stay: nothing is compiled)."""
    from jaxtune.planner import estimate
    from jaxtune.planner.confirm import _mesh
    from jaxtune.planner.program_flops import step_flops
    from jaxtune.planner.slices import libtpu_quiet, topology_devices, tpu_slice
    from jaxtune.spine.run import abstract_run

    cfg, plan, device = model_and_plan(row)
    count = math.prod(parse_sizes(result["mesh"]).values())
    est = estimate(cfg, plan, device.with_count(count))
    with libtpu_quiet():
        mesh = _mesh(plan, topology_devices(tpu_slice(device)))
        flops = step_flops(abstract_run(cfg, plan, mesh)) / mesh.size
    out = {**result, **planner_columns(est), "program_flops": flops}
    out["modelled_step_seconds"] = flops / est.device.peak(plan.forward.compute_dtype)
    peak = out["compiled_bytes"] + out.get("rollout_extra_bytes", 0)
    out["compiler_fits"] = not out["over_memory"] and peak + est.reserve_bytes <= est.device.usable_bytes
    return out


def parse_sizes(mesh: str) -> dict:
    return {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}


def measure(row) -> dict:
    """Compile one row for its slice and return the planner's and the compiler's figures."""
    from jaxtune.planner.command import confirm_plan

    cfg, plan, device = model_and_plan(row)
    start = time.perf_counter()
    c = confirm_plan(cfg, plan, device)
    seconds = time.perf_counter() - start
    compiled = c.compiled
    out = {"label": label(row), "model": row[0], "method": row[1], "objective": row[2], "seq": row[3],
           "batch": row[4], "target": row[5], "mesh": row[6], "remat": row[7], "topology": c.topology,
           "seconds": round(seconds, 1), "compile_seconds": round(compiled.compile_seconds, 1),
           "compiled_bytes": compiled.total_bytes, "host_bytes": compiled.host_bytes,
           "argument_bytes": compiled.argument_bytes,
           "temp_bytes": compiled.temp_bytes, "over_memory": compiled.over_memory, "attention": compiled.attention,
           "compiler_fits": c.fits, "program_flops": compiled.flops, "xla_flops": compiled.xla_flops,
           "xla_bytes_accessed": compiled.xla_bytes_accessed, "collectives": compiled.collectives,
           **planner_columns(c.estimate)}
    out.update(c.modelled_step())
    if c.rollout is not None:
        out["rollout_bytes"] = c.rollout.total_bytes
        out["rollout_extra_bytes"] = c.peak_bytes - compiled.total_bytes
    out["assigned_bytes"] = assigned_bytes(os.environ.get("TPU_TABLE_DUMP", ""))
    return out


def assigned_bytes(dump: str) -> int:
    """HBM bytes of the step's buffer assignment (arguments and temporaries, XLA's memory-usage report of the
    default memory space), from the dump XLA_FLAGS asked for; 0 without one. On TPU it is below memory_analysis'
    arguments + temporaries (measured: 8.17 against 9.72 GiB for Llama-3.2-3B's full fine-tune on v6e-8)."""
    reports = sorted(Path(dump).glob("*jit_step*memory-usage-report.txt"), key=lambda p: p.stat().st_mtime) if dump \
        else []
    if not reports:
        return 0
    lines = reports[-1].read_text().splitlines()
    at = lines.index("Memory Space: default (color=0)")
    return int(lines[at + 1].split()[2])


def error_line(stderr: str) -> str:
    """The exception a row's subprocess ended with (jax's note on its filtered frames comes after it)."""
    lines = [line for line in stderr.strip().splitlines() if re.match(r"[\w.]*(Error|Exception)\b", line)]
    return (lines or stderr.strip().splitlines() or ["?"])[-1]


def table(results: list[dict]) -> str:
    """The Markdown table (MiB per device; relative errors of the planner against the compiler)."""
    mib = 1 << 20
    lines = ["| configuration | planner MiB | compiler MiB: memory_analysis / buffers | planner vs compiler: "
             "memory_analysis / buffers | planner FLOPs vs program | XLA cost_analysis FLOPs / program | "
             "modelled step s (MFU ceiling) | fits: planner / compiler | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | | | error: {r['error'][:80]} | | | | | |")
            continue
        compiled = peak(r) if not r["over_memory"] else None
        bytes_err = f"{r['planner_bytes'] / compiled - 1:+.1%}" if compiled else "compiler refused (over HBM)"
        mfu = r["planner_flops"] / r["program_flops"] if r["program_flops"] else 0.0
        assigned = r.get("assigned_bytes", 0) + r.get("rollout_extra_bytes", 0) if r.get("assigned_bytes") else 0
        if assigned:
            bytes_err += f" / {r['planner_bytes'] / assigned - 1:+.1%}"
        flops = (f"{r['planner_flops'] / r['program_flops'] - 1:+.1%} | {r['xla_flops'] / r['program_flops']:.3f} | "
                 f"{r['modelled_step_seconds']:.3f} ({mfu:.0%})" if r["program_flops"] else "| | ")
        lines.append(
            f"| {r['label']} | {r['planner_bytes'] / mib:,.0f} | "
            f"{compiled / mib if compiled else r['compiled_bytes'] / mib:,.0f} / {assigned / mib:,.0f} | {bytes_err} | "
            f"{flops} | {'yes' if r['planner_fits'] else 'no'} / "
            f"{'yes' if r['compiler_fits'] else 'no'} | {r['compile_seconds']:.0f} |")
    return "\n".join(lines)


def peak(result: dict) -> int:
    """The compiler's bytes a device at the iteration's peak: the step's, or GRPO's rollout with the optimizer state
    beside it."""
    return result["compiled_bytes"] + result.get("rollout_extra_bytes", 0)


def summary(results: list[dict]) -> str:
    ok = [r for r in results if "error" not in r and not r["over_memory"]]
    errs = [r["planner_bytes"] / peak(r) - 1 for r in ok]
    flops = [r["planner_flops"] / r["program_flops"] - 1 for r in ok if r["program_flops"]]
    wrong_fits = [r["label"] for r in results if "error" not in r and r["planner_fits"] and not r["compiler_fits"]]
    assigned = [r["planner_bytes"] / (r["assigned_bytes"] + r.get("rollout_extra_bytes", 0)) - 1 for r in ok
                if r.get("assigned_bytes")]
    against_buffers = (f"; against the buffer assignment: median {statistics.median(assigned):+.1%}, median |error| "
                       f"{statistics.median(map(abs, assigned)):.1%}, worst {max(assigned, key=abs):+.1%}"
                       if assigned else "")
    held = {label(row) for row in ROWS[-HELD_OUT:]}
    held_errs = [r["planner_bytes"] / peak(r) - 1 for r in ok if r["label"] in held]
    held_flops = [r["planner_flops"] / r["program_flops"] - 1 for r in ok if r["label"] in held and r["program_flops"]]
    held_out = (f"; of them held out (compiled after the TPU rules were calibrated): {len(held_errs)}, bytes median "
                f"{statistics.median(held_errs):+.1%}, worst {max(held_errs, key=abs):+.1%}, FLOPs worst "
                f"{max(held_flops, key=abs):+.1%}" if held_errs and held_flops else "")
    return (f"{len(ok)} compiled configurations: planner vs compiler bytes (memory_analysis) median "
            f"{statistics.median(errs):+.1%}, median |error| {statistics.median(map(abs, errs)):.1%}, worst "
            f"{max(errs, key=abs):+.1%}{against_buffers}; FLOPs "
            f"median {statistics.median(flops):+.1%}, worst {max(flops, key=abs):+.1%}; planner says fits where "
            f"the compiler does not: {len(wrong_fits)} {wrong_fits}{held_out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose label contains this")
    parser.add_argument("--table", action="store_true", help="print the results file's table")
    parser.add_argument("--again", action="store_true", help="recompile rows already in the results file")
    parser.add_argument("--replan", action="store_true", help="recompute the planner's columns, compile nothing")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # one row, in a subprocess
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(measure(ROWS[args.row])))
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    if args.replan:
        rows = {label(row): row for row in ROWS}
        results = [r if "error" in r else replan(r, rows[r["label"]]) for r in results]
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    elif not args.table:
        done = {r["label"] for r in results if "error" not in r}
        for i, row in enumerate(ROWS):
            if args.only not in label(row) or (label(row) in done and not args.again):
                continue
            with tempfile.TemporaryDirectory() as dump:
                flags = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*jit_step.*"
                out = subprocess.run([sys.executable, __file__, "--row", str(i)], capture_output=True, text=True,
                                     timeout=3600, env={**os.environ, "JAX_PLATFORMS": "cpu", "TPU_TABLE_DUMP": dump,
                                                        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}"})
            lines = out.stdout.strip().splitlines()
            if out.returncode == 0 and lines:
                result = json.loads(lines[-1])
            else:
                result = {"label": label(row), "error": error_line(out.stderr)}
            results = [r for r in results if r["label"] != label(row)] + [result]
            results.sort(key=lambda r: [label(x) for x in ROWS].index(r["label"]))
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
            print(result.get("error") or f"{label(row)}: planner {result['planner_bytes'] / 2**20:,.0f} MiB, "
                  f"compiler {result['compiled_bytes'] / 2**20:,.0f} MiB, compiled in "
                  f"{result['compile_seconds']:.0f} s", flush=True)
    print(table(results))
    print()
    print(summary(results))


if __name__ == "__main__":
    main()
