"""What a model directory or GGUF file holds (`model_summary`, for `jaxtune info`), read from its config and tensor
headers: no weights are loaded."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import jax

from jaxtune.config.model import ATTENTION_MODULES, hf_module_name
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import checked_reader
from jaxtune.models.params import MLP_MODULES, QK_NORMS, ParamSpec, is_norm, param_specs

PER_LAYER_INPUTS = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm",
                    "per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")  # Gemma 4's


def _group(path: tuple[str, ...]) -> str:
    if path[0] in ("embed_tokens", "lm_head", "norm"):
        return "norms" if path[0] == "norm" else path[0]
    if path[0] in PER_LAYER_INPUTS or (len(path) > 1 and path[1] in PER_LAYER_INPUTS):
        return "per-layer inputs"
    module = hf_module_name(path[1])  # Gemma 4's stacks of other shapes: the module they are
    if module in QK_NORMS:  # inside self_attn, as transformers counts them
        return "attention"
    if is_norm(path[-1]) or is_norm(path[1]):
        return "norms"
    if path[1].startswith("linear_attn."):
        return "linear attention"
    return "attention" if module in ATTENTION_MODULES else "mlp" if module in MLP_MODULES else module


def model_summary(directory: str | Path) -> dict:
    """Architecture, parameter counts by group, and the weights' types and bytes as stored (a GGUF file's
    llama.cpp types, Q4_1, Q8_0, F32, ...) of a Hugging Face model directory or GGUF file.

    Every tensor's name and shape is checked against the config on the way (headers only, no data read).
    """
    cfg = load_config(directory)
    counts: Counter[str] = Counter()
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    for path, spec in flat:
        counts[_group(tuple(k.key for k in path))] += spec.size
    dtypes: Counter[str] = Counter()
    weight_bytes = 0
    with checked_reader(directory, cfg) as reader:
        for name in reader.names():  # as stored: a GGUF's block types and bytes, not the float32 they read as
            dtypes[reader.stored_type(name)] += math.prod(reader.shape(name))
            weight_bytes += reader.stored_bytes(name)
    return {
        "architecture": cfg.architecture,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "parameters": sum(counts.values()),
        "parameters_by_group": dict(counts),
        "dtypes": dict(dtypes.most_common()),
        "weights_bytes": weight_bytes,
    }
