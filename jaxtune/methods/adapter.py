"""Bottleneck adapters (Houlsby et al. 2019): x + up(silu(down(x))) after each layer's attention and MLP.

Leaves `attn_adapter` / `mlp_adapter`, each `down` {kernel [L, D, m] (N(0, 0.02)), bias [L, m]} and `up` {kernel
[L, m, D] (zeros), bias [L, D]}: the identity at start (`models/llama.decoder_layer` applies them). PEFT has no
such adapters; they are written in PEFT's layout under jaxtune's own peft_type JAXTUNE_BOTTLENECK.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.config.method import MethodConfig
from jaxtune.errors import check_range
from jaxtune.methods.base import Method, PeftFormat, PlannerCosts, module_keys


@dataclass(frozen=True, kw_only=True)
class AdapterConfig(MethodConfig):
    """adapter_size: the bottleneck's width m."""

    kind: ClassVar[str] = "adapter"

    adapter_size: int = 64

    def __post_init__(self):
        check_range("adapter_size", self.adapter_size, 1)

ADAPTERS = ("attn_adapter", "mlp_adapter")
BOTTLENECK_LEAVES = [(a, p, leaf) for a in ADAPTERS for p in ("down", "up") for leaf in ("kernel", "bias")]


def _adapter(L: int, D: int, size: int, key) -> dict:
    return {
        "down": {"kernel": 0.02 * jax.random.normal(key, (L, D, size), jnp.float32), "bias": jnp.zeros((L, size))},
        "up": {"kernel": jnp.zeros((L, size, D), jnp.float32), "bias": jnp.zeros((L, D), jnp.float32)},
    }


def add_adapters(params: dict, cfg: ModelConfig, method: AdapterConfig, key: jax.Array) -> dict:
    keys = module_keys(key)
    adapters = {name: _adapter(cfg.num_layers, cfg.hidden_size, method.adapter_size, keys[where])
                for name, where in zip(ADAPTERS, ("attn", "mlp"))}
    return {**params, "layers": {**params["layers"], **adapters}}


def _name(adapter: str, proj: str, leaf: str, layer: int) -> str:
    return f"base_model.model.model.layers.{layer}.{adapter}.{proj}.{'weight' if leaf == 'kernel' else 'bias'}"


def _peft_tensors(params: dict, cfg: ModelConfig, method: AdapterConfig) -> dict[str, np.ndarray]:
    state = {}
    for adapter, proj, leaf in BOTTLENECK_LEAVES:
        value = np.asarray(params["layers"][adapter][proj][leaf], np.float32)
        for i in range(cfg.num_layers):
            state[_name(adapter, proj, leaf, i)] = np.ascontiguousarray(value[i].T if leaf == "kernel" else value[i])
    return state


def _peft_load(state: dict, params: dict, cfg: ModelConfig, method: AdapterConfig) -> dict:
    layers = dict(params["layers"])
    for adapter, proj, leaf in BOTTLENECK_LEAVES:
        value = np.stack([state[_name(adapter, proj, leaf, i)] for i in range(cfg.num_layers)])
        stored = np.swapaxes(value, 1, 2) if leaf == "kernel" else value
        layers[adapter] = {**layers[adapter], proj: {**layers[adapter][proj], leaf: jnp.asarray(stored)}}
    return {**params, "layers": layers}


def _saved(method, adapted, out_width, b, T, D) -> list:
    """Each adapter's input and its [b, T, m] hidden units (before and after the activation)."""
    return [(f"{where} adapter {what}", (b, T, D) if what == "input" else (b, T, 2 * method.adapter_size), False)
            for where in ("attention", "mlp") for what in ("input", "hidden")]


ADAPTER = Method(
    kind="adapter",
    options=AdapterConfig,
    add_leaves=add_adapters,
    leaves=ADAPTERS,
    leaf_axes={**{("layers", a, "down", "kernel"): ("layers", "embed", "adapter") for a in ADAPTERS},
               **{("layers", a, "down", "bias"): ("layers", "adapter") for a in ADAPTERS},
               **{("layers", a, "up", "kernel"): ("layers", "adapter", "embed") for a in ADAPTERS},
               **{("layers", a, "up", "bias"): ("layers", "embed") for a in ADAPTERS}},
    peft=PeftFormat(("JAXTUNE_BOTTLENECK",), (), lambda cfg, method: {"peft_type": "JAXTUNE_BOTTLENECK",
                                                                       "adapter_size": method.adapter_size},
                    _peft_tensors, lambda config, get, targets: AdapterConfig(
                        adapter_size=int(config["adapter_size"])), _peft_load),
    costs=PlannerCosts(saved=_saved),
)
