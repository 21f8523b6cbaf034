"""Small random models written as Hugging Face directories: for the demo, examples and benchmarks; a tiny Gemma 3
vision-language model (a character-level tokenizer holding Gemma 3's special tokens, its released chat template)."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import tokenizers

from jaxtune.config import ModelConfig, RopeScaling, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.models.hf_weights import save_model
from jaxtune.models.params import ParamSpec, init_params

ARCH_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
              "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
              "olmo3": "Olmo3ForCausalLM", "gpt_oss": "GptOssForCausalLM", "llama4": "Llama4ForCausalLM",
              "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
              "llama4_maverick": "Llama4ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
              "gemma4": "Gemma4ForCausalLM"}


def family_traits(arch: str, num_layers: int) -> dict:
    """What sets `arch` (a key of ARCH_NAMES) apart from Llama, as `ModelConfig` fields, in a tiny model: Gemma's
    sliding layers alternate with full ones (Gemma 3 has one full layer in six at scale; two layers show both);
    Phi-3's fused projections, with Phi-4-mini's partial rotary factor; mixtures of 4 to 8 experts, top 2, Mixtral's
    as wide as the MLP, Qwen's narrower, Qwen2-MoE's with a shared expert; SmolLM3's NoPE layer last (every fourth
    at scale), OLMo's norms (OLMo 3's first layer sliding); gpt-oss's experts with biases, sinks, sliding and
    full layers; Llama 4's chunked rotating layers, then a NoPE one (Maverick's with dense MLP layers between the
    mixtures); Qwen3.5's Gated DeltaNet layer, then a gated attention one (three to one at scale); Qwen3-Next's the
    same, fused, with Qwen2-MoE's mixture; DeepSeek-V3's latent attention (24-wide queries and keys, 8 of them
    rotated, 16-wide values) and a dense first layer before mixtures of 8 experts in 4 groups; Gemma 4's sliding
    and full layers (these twice as wide, one key/value head, values from the keys), the last half (of four or more)
    sharing the first half's keys and values with double-wide MLPs, per-layer inputs, 4 experts (top 2) beside
    every MLP."""
    olmo = dict(post_norms=True, qk_norm=True, qk_norm_whole=True, norm_float32_scale=True)
    known: dict[str, dict[str, Any]] = {
        "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True),
        "mistral": dict(sliding_windows=(64,) * num_layers),
        "phi3": dict(fused_projections=True, partial_rotary_factor=0.75),
        "mixtral": dict(num_experts=4, experts_per_token=2),
        "qwen2_moe": dict(qkv_bias=True, num_experts=4, experts_per_token=2, expert_size=64,
                          shared_expert_size=128, normalize_top_k=False),
        "qwen3_moe": dict(qk_norm=True, num_experts=8, experts_per_token=2, expert_size=64),
        "smollm3": dict(nope_layers=(num_layers - 1,), tie_word_embeddings=True), "olmo2": olmo,
        "olmo3": dict(olmo, local_rope_theta=10_000.0,
                      sliding_windows=tuple(64 if i % 2 == 0 else 0 for i in range(num_layers))),
        "gpt_oss": dict(num_experts=4, experts_per_token=2, expert_size=64, intermediate_size=64, router_bias=True,
                        expert_bias=True, attention_sinks=True, hidden_act="clamped_swiglu", qkv_bias=True, o_bias=True,
                        norm_float32_scale=True, sliding_windows=tuple(64 if i % 2 == 0 else 0
                                                                       for i in range(num_layers))),
        "llama4": dict(num_experts=4, experts_per_token=1, expert_size=64, shared_expert_size=64,
                       shared_expert_gated=False, router_activation="sigmoid", expert_input_scaled=True,
                       normalize_top_k=False, rope_interleaved=True, qk_l2_norm=True, temperature_floor=64,
                       nope_layers=(num_layers - 1,), sliding_windows=(-64,) * (num_layers - 1) + (0,)),
        "qwen3_5": dict(linear_attention_layers=tuple(range(0, num_layers, 2)), linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        attention_output_gate=True, norm_unit_offset=True, qk_norm=True, partial_rotary_factor=0.25)}
    known["llama4_maverick"] = dict(known["llama4"], dense_layers=tuple(range(0, num_layers, 2)))
    known["qwen3_next"] = dict(known["qwen3_5"], linear_attention_fused=True, num_experts=8, experts_per_token=2,
                               expert_size=64, intermediate_size=64, shared_expert_size=128)
    known["deepseek_v3"] = dict(
        head_dim=24, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32, q_lora_rank=48, rope_interleaved=True,
        num_experts=8, experts_per_token=2, expert_size=64, shared_expert_size=64, shared_expert_gated=False,
        router_activation="sigmoid", router_choice_bias=True, router_groups=4, router_top_groups=2,
        routed_scaling_factor=2.5, dense_layers=(0,))
    known["gemma4"] = dict(
        hidden_act="gelu_tanh", scale_embeddings=True, sandwich_norms=True, norm_float32_scale=True, qk_norm=True,
        value_norm=True, query_pre_attn_scalar=1.0, layer_scalar=True, tie_word_embeddings=True,
        rope_theta=1_000_000.0, rope_scaling=RopeScaling("proportional", 1.0, rotated_fraction=0.25),
        local_rope_theta=10_000.0, sliding_windows=tuple(0 if i % 2 else 64 for i in range(num_layers)),
        global_head_dim=64, global_kv_heads=1, values_from_keys=True,
        shared_kv_layers=num_layers // 2 if num_layers >= 4 else 0, wide_shared_mlp=num_layers >= 4,
        per_layer_input_size=16, per_layer_vocab_size=512, experts_beside_mlp=True,
        num_experts=4, experts_per_token=2, expert_size=64, final_logit_softcap=30.0)
    traits = known.get(arch, {})
    if arch.startswith("gemma") and arch != "gemma4":
        traits = dict(hidden_act="gelu_tanh", norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True,
                      tie_word_embeddings=True, query_pre_attn_scalar=24.0,
                      sliding_windows=tuple(0 if i % 2 else 64 for i in range(num_layers)))
        traits.update(dict(attn_logit_softcap=50.0, final_logit_softcap=30.0) if arch == "gemma2" else
                      dict(qk_norm=True, rope_theta=1_000_000.0, local_rope_theta=10_000.0))
    return traits


def tiny_model_config(arch: str = "llama", **overrides) -> ModelConfig:
    """The tiny shape of `tiny_config` for `arch`, sized for the built-in byte-level tokenizer."""
    tokenizer = Tokenizer.byte_level()
    base = dict(architecture=ARCH_NAMES[arch], vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                eos_token_id=(tokenizer.eos_id,), pad_token_id=tokenizer.pad_id,
                **family_traits(arch, overrides.get("num_layers", 2)))
    return tiny_config(**{**base, **overrides})


def write_random_model(directory: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Random weights and the byte-level tokenizer, saved where transformers and jaxtune can both load them."""
    cfg = tiny_model_config(arch, **overrides)
    params = init_params(cfg, jax.random.key(seed))
    save_model(directory, cfg, params)
    Tokenizer.byte_level().save(directory)
    return Path(directory)


# gemma-3-4b-it's chat_template.json
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")

SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<image_soft_token>": 90, "<start_of_image>": 91,
           "<end_of_image>": 92, "<start_of_turn>": 93, "<end_of_turn>": 94}
CHARS = "\n " + string.ascii_letters + string.digits + ".,?!:'-"  # ids 4 .. 74


def write_gemma3_tokenizer(directory: str | Path) -> None:
    """tokenizer.json (characters, no merges; the special tokens whole) and a tokenizer_config.json with the chat
    template and transformers' Gemma 3 image token attributes, for a 96-token vocabulary."""
    vocab = dict(SPECIAL)
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<unused{i}>": i for i in range(96) if i not in vocab.values()})
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL))
    backend.decoder = tokenizers.decoders.Fuse()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": GEMMA3_CHAT_TEMPLATE,
              "extra_special_tokens": {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                       "eoi_token": "<end_of_image>"}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


GEMMA3_TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=512,
            rms_norm_eps=1e-5, sliding_window=3, model_type="gemma3_text",
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# 64-pixel images in 16-pixel patches: a 4 x 4 grid pooled to 2 x 2 soft tokens an image
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=64,
              patch_size=16, vision_use_head=False, model_type="siglip_vision_model")
GEMMA3_IMAGE, GEMMA3_BOI, GEMMA3_EOI = 90, 91, 92


def write_gemma3_files(directory: str | Path, pan_and_scan: bool = False, **text) -> Path:
    """A tiny Gemma 3 VLM directory without weights: config.json (`text` over GEMMA3_TEXT), preprocessor_config.json,
    processor_config.json and chat_template.json (the image_seq_length and chat template transformers' Gemma3Processor
    reads, as released directories hold them), the tokenizer."""
    directory = Path(directory)
    write_gemma3_tokenizer(directory)
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": GEMMA3_TEXT | text, "vision_config": GEMMA3_VISION, "mm_tokens_per_image": 4,
              "image_token_index": GEMMA3_IMAGE, "boi_token_index": GEMMA3_BOI, "eoi_token_index": GEMMA3_EOI,
              "eos_token_id": [1, 94], "bos_token_id": 2, "pad_token_id": 0}  # <eos> and <end_of_turn>, as released
    (directory / "config.json").write_text(json.dumps(config))
    processing = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 64, "width": 64},
                  "do_pan_and_scan": pan_and_scan, "pan_and_scan_min_crop_size": 8,
                  "pan_and_scan_max_num_crops": 2, "pan_and_scan_min_ratio_to_activate": 1.5}
    (directory / "preprocessor_config.json").write_text(json.dumps(processing))
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                                 "image_seq_length": config["mm_tokens_per_image"]}))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3_CHAT_TEMPLATE}))
    return directory

def write_random_vision_model(directory: str | Path, seed: int = 0, **text) -> Path:
    """A tiny Gemma 3 vision-language model with random weights (`write_gemma3_files`' shape, `text` over its text
    config), its tensors named as transformers 5 saves Gemma3ForConditionalGeneration, so jaxtune and transformers
    both load it: for the vision demo, examples and tests."""
    from jaxtune.io.safetensors import write_weights
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.hf_weights import tensor_entries
    from jaxtune.models.vision.gemma3 import GEMMA3

    directory = write_gemma3_files(directory, **text)
    cfg, vision = load_config(directory), GEMMA3.read_config(directory)
    text_key, vision_key = jax.random.split(jax.random.key(seed))
    specs, treedef = jax.tree.flatten(GEMMA3.param_specs(vision), is_leaf=lambda x: isinstance(x, ParamSpec))
    leaves = [jnp.ones(s.shape) if s.init == "ones" else jnp.zeros(s.shape) if s.init == "zeros" else
              cfg.initializer_range * jax.random.normal(k, s.shape)
              for s, k in zip(specs, jax.random.split(vision_key, len(specs)))]
    entries = (tensor_entries(init_params(cfg, text_key), cfg)
               + GEMMA3.tensor_entries(jax.tree.unflatten(treedef, leaves), vision))
    named = {"model.": "model.language_model.", "vision_tower.": "model.vision_tower.vision_model.",
             "multi_modal_projector.": "model.multi_modal_projector."}
    write_weights(directory, [(next(new + name[len(old):] for old, new in named.items() if name.startswith(old)), *rest)
                              for name, *rest in entries])
    return directory
