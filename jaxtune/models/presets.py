"""Small random models written as Hugging Face directories: for the demo, examples and benchmarks."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxtune.config import ModelConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.models.hf_weights import save_model
from jaxtune.models.params import init_params

ARCH_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}


def tiny_model_config(arch: str = "llama", **overrides) -> ModelConfig:
    """The tiny shape of `tiny_config` for `arch`, sized for the built-in byte-level tokenizer."""
    tokenizer = Tokenizer.byte_level()
    qwen = arch == "qwen2"
    base = dict(architecture=ARCH_NAMES[arch], vocab_size=tokenizer.vocab_size, qkv_bias=qwen, qk_norm=arch == "qwen3",
                bos_token_id=tokenizer.bos_id, eos_token_id=(tokenizer.eos_id,), pad_token_id=tokenizer.pad_id)
    if arch == "mistral":
        base["sliding_windows"] = (64,) * overrides.get("num_layers", 2)
    return tiny_config(**{**base, **overrides})


def write_random_model(directory: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Random weights and the byte-level tokenizer, saved where transformers and jaxtune can both load them."""
    cfg = tiny_model_config(arch, **overrides)
    params = init_params(cfg, jax.random.key(seed))
    save_model(directory, cfg, params)
    Tokenizer.byte_level().save(directory)
    return Path(directory)
