"""Shared fixtures: tiny random transformers models saved as Hugging Face directories (no network)."""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CPU backend only: with libtpu installed (the test extra, for compiling TPU programs from topologies), JAX would
# otherwise try to start a TPU backend in every process and write libtpu's notices into the CLI's one-line stderr.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's compiled programs are kept on disk and shared by the test processes (xdist workers and the CLI runs they
# start), which compile the same tiny models' steps over and over: a third of the suite's time. The directory is
# per XLA_FLAGS, so the AVX2-forced pass never reuses programs compiled for AVX-512.
_flags = hashlib.sha256(os.environ.get("XLA_FLAGS", "").encode()).hexdigest()[:12]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"jaxtune-tests-xla-{_flags}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import numpy as np
import pytest
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
}


@pytest.fixture(autouse=True)
def _xla_flags_as_they_were():
    """XLA_FLAGS restored after every test: code run in-process (`plan --target cpu-8` asks for fake devices) may set
    it, and a later test's subprocess in the same worker would inherit eight CPU devices."""
    before = os.environ.get("XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = before


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1) (Gemma's weights N(0, 0.1): it scales by 1 + weight),
    biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    unit = 0.0 if type(model).__name__.startswith("Gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(unit + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))
    return model.eval()


def make_hf_model(arch: str, directory, seed: int = 0, **overrides):
    """A random transformers model of `arch`, saved with save_pretrained into `directory`; returns the model."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**copy.deepcopy({**TINY, **extra, **overrides}))  # configs edit their rope dicts in place
    torch.manual_seed(seed)
    model = randomize(model_cls(config), seed)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Factory: arch name -> (directory, transformers model), cached for the session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            directory = tmp_path_factory.mktemp(arch)
            cache[arch] = (directory, make_hf_model(arch, directory))
        return cache[arch]

    return get


def padded_batch(vocab: int, seed: int = 0):
    """Token ids [3, 12], a left-padded row and a right-padded row, mask and HF-style positions."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, vocab, (3, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, positions


def numpy_random_params(cfg, seed: int = 0) -> dict:
    """Random weights of `cfg` drawn with numpy (no compile), scaled as `randomize` so logits are O(1)."""
    import jax

    from jaxtune.models.params import abstract_params

    rng = np.random.RandomState(seed)

    def draw(path, spec):
        if "norm" in jax.tree_util.keystr(path):
            return 1 + 0.1 * rng.randn(*spec.shape).astype(np.float32)
        fan_in = spec.shape[-2] if "kernel" in jax.tree_util.keystr(path) else 1
        return (rng.randn(*spec.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(cfg))
