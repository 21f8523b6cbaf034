"""Prefix tuning (Li & Liang 2021): learned keys and values every layer attends to before the tokens.

Leaves `layers.prefix.key` / `.value` [L, P, K, hd] (N(0, 1), as PEFT's embedding), used unrotated as PEFT's
past_key_values (`models/llama.attention`, `models/kv_cache`). PEFT's tensor: `prompt_embeddings` [P, L 2 K hd].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.config.method import MethodConfig
from jaxtune.errors import JaxtuneError, check_range
from jaxtune.methods.base import Method, PeftFormat, PlannerCosts, module_keys


@dataclass(frozen=True, kw_only=True)
class PrefixConfig(MethodConfig):
    """num_virtual_tokens: the learned key/value positions every layer attends to first (PEFT's field)."""

    kind: ClassVar[str] = "prefix"

    num_virtual_tokens: int = 16

    def __post_init__(self):
        check_range("num_virtual_tokens", self.num_virtual_tokens, 1)


def add_prefix(params: dict, cfg: ModelConfig, method: PrefixConfig, key: jax.Array) -> dict:
    if cfg.linear_attention_layers:  # PEFT's past key values: one pair every layer
        raise JaxtuneError(f"prefix tuning needs keys and values in every layer; {cfg.architecture}'s Gated DeltaNet "
                           f"layers {list(cfg.linear_attention_layers)} have none (use LoRA)")
    if cfg.kv_lora_rank:  # its cache holds latents, where PEFT's prefix would be per-head keys and values
        raise JaxtuneError(f"prefix tuning needs per-head keys and values; {cfg.architecture}'s latent attention "
                           "caches a latent a token (use LoRA)")
    if cfg.global_head_dim:  # keys of two widths, and layers holding none (PEFT's prefix is one shape a layer)
        raise JaxtuneError(f"prefix tuning needs keys and values of one shape in every layer; {cfg.architecture}'s "
                           f"full layers are {cfg.global_head_dim} wide, its sliding ones {cfg.head_dim}, and its last "
                           f"{cfg.shared_kv_layers} reuse earlier layers' (use LoRA)")
    shape = (cfg.num_layers, method.num_virtual_tokens, cfg.num_kv_heads, cfg.head_dim)
    k_key, v_key = jax.random.split(module_keys(key)["prefix"])
    prefix = {"key": jax.random.normal(k_key, shape), "value": jax.random.normal(v_key, shape)}
    return {**params, "layers": {**params["layers"], "prefix": prefix}}


def _peft_config(cfg: ModelConfig, method: PrefixConfig) -> dict:
    return {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": method.num_virtual_tokens,
            "num_layers": cfg.num_layers, "num_attention_heads": cfg.num_kv_heads, "token_dim": cfg.kv_size,
            "encoder_hidden_size": cfg.kv_size, "num_transformer_submodules": 1, "prefix_projection": False}


def _peft_tensors(params: dict, cfg: ModelConfig, method: PrefixConfig) -> dict[str, np.ndarray]:
    prefix = params["layers"]["prefix"]
    stacked = np.stack([np.asarray(prefix["key"], np.float32), np.asarray(prefix["value"], np.float32)], axis=1)
    return {"prompt_embeddings": np.ascontiguousarray(  # [L, 2, P, K, hd] -> [P, L 2 K hd]
        stacked.transpose(2, 0, 1, 3, 4).reshape(method.num_virtual_tokens, -1))}


def _method_of(config: dict, get, targets) -> PrefixConfig:
    if config.get("prefix_projection"):
        raise JaxtuneError("prefix tuning with prefix_projection=true is not supported")
    return PrefixConfig(num_virtual_tokens=int(config["num_virtual_tokens"]))


def _peft_load(state: dict, params: dict, cfg: ModelConfig, method: PrefixConfig) -> dict:
    emb = state["prompt_embeddings"].reshape(method.num_virtual_tokens, cfg.num_layers, 2, cfg.num_kv_heads,
                                             cfg.head_dim)
    stacked = emb.transpose(1, 2, 0, 3, 4)  # [L, 2, P, K, hd]
    prefix = {"key": jnp.asarray(stacked[:, 0]), "value": jnp.asarray(stacked[:, 1])}
    return {**params, "layers": {**params["layers"], "prefix": prefix}}


PREFIX = Method(
    kind="prefix",
    options=PrefixConfig,
    add_leaves=add_prefix,
    leaves=("prefix",),
    leaf_axes={("layers", "prefix", "key"): ("layers", "prefix", "kv_heads", "head_dim"),
               ("layers", "prefix", "value"): ("layers", "prefix", "kv_heads", "head_dim")},
    peft=PeftFormat(("PREFIX_TUNING",), ("num_virtual_tokens",), _peft_config, _peft_tensors, _method_of,
                    _peft_load),
    costs=PlannerCosts(attended_tokens=lambda method: method.num_virtual_tokens),
)
