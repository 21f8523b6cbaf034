"""Which model to plan for: a Hugging Face directory or GGUF file (`model_from_directory`: its config and stored
dtype), or a standard Llama shape of a given size for the quick form `--params MILLIONS` (`standard_config`).

The standard shapes are LLaMA's (Touvron et al. 2023, table 2) and, below 7B, the GPT-3 paper's widths (Brown et
al. 2020, table 2.1): the width of the nearest published size, SwiGLU's MLP of 8/3 x width rounded up to 256,
heads of 128 (64 below 1B), a 32,000-token vocabulary, and as many layers as it takes to reach the size.
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import stored_dtype
from jaxtune.models.summary import model_summary

# (published size in millions, width, head_dim)
WIDTHS = ((125, 768, 64), (350, 1024, 64), (760, 1536, 64), (1300, 2048, 128), (2700, 2560, 128),
          (6700, 4096, 128), (13000, 5120, 128), (32500, 6656, 128), (65200, 8192, 128))
VOCAB = 32000


def standard_config(millions: float) -> ModelConfig:
    """A Llama shape with about `millions` million parameters (untied head, full multi-head attention)."""
    if millions <= 0:
        raise JaxtuneError(f"--params {millions}: the model size must be a positive number of millions")
    _, width, head_dim = min(WIDTHS, key=lambda w: abs(math.log(w[0] / millions)))
    mlp = 256 * math.ceil(8 * width / 3 / 256)
    per_layer = 4 * width * width + 3 * width * mlp + 2 * width
    layers = max(1, round((millions * 1e6 - 2 * VOCAB * width - width) / per_layer))
    heads = width // head_dim
    return ModelConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=mlp, num_layers=layers,
                       num_heads=heads, num_kv_heads=heads, head_dim=head_dim)


def model_from_directory(directory: str | Path) -> tuple[ModelConfig, str]:
    """(config, stored weight dtype) of a Hugging Face model directory or GGUF file: the config and tensor headers
    only. The dtype is the one `load_model` gives the weights by default (a GGUF's quantised blocks: float32)."""
    model_summary(directory)  # every tensor's name and shape checked against the config
    return load_config(directory), stored_dtype(directory)
