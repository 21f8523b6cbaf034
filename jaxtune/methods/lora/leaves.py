"""LoRA's leaves in the tree: a module's `lora_a` [L, in, R] (PEFT's kaiming-uniform init) and `lora_b` [L, R, out]
(zeros), R its largest rank (`lora.layout`); DoRA's `magnitude` [L, out]; `lora_bias` [L, out]; an expert stack's
`lora_a` [L, E, in, r] and `lora_b` [L, E, r, out]. QLoRA's frozen base quantised (`quantize_base`), and PEFT's
parameter counts (`count`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.config.model import LINEAR_MODULE_NAMES, hf_module_name
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import module_keys
from jaxtune.methods.lora.layout import ModuleLoRA, Stacks, lora_layout
from jaxtune.methods.lora.options import LoRAConfig, QLoRAConfig
from jaxtune.models.quant import QuantizedArray, dequantize, full_shape, quantize_int8, quantize_nf4

LORA_LEAVES = ("lora_a", "lora_b", "magnitude", "lora_bias")
LORA_AXES = {
    "lora_a": lambda layers, d_in, d_out: (layers, d_in, "lora_rank"),
    "lora_b": lambda layers, d_in, d_out: (layers, "lora_rank", d_out),
    "lora_bias": lambda layers, d_in, d_out: (layers, d_out),
    "magnitude": lambda layers, d_in, d_out: (layers, d_out),
}


def _lora_leaves(kernel, lora: ModuleLoRA, method: LoRAConfig, key) -> dict:
    """LoRA's leaves for one module, rank `lora.max_rank`; a layer of smaller rank holds zeros beyond its rank."""
    L, d_in, d_out = full_shape(kernel)
    R = lora.max_rank
    if method.init == "gaussian":  # PEFT's "gaussian": normal_(std=1 / r) on lora_A.weight, r the layer's rank
        std_L = 1 / np.maximum(np.asarray(lora.ranks, np.float32), 1)
        lora_a = jax.random.normal(key, (L, d_in, R), jnp.float32) * std_L[:, None, None]
    else:  # torch kaiming_uniform_(a=sqrt(5)) on lora_A.weight [r, in]; BASE_INITS' values come from `lora_init`
        bound = 1 / math.sqrt(d_in)
        lora_a = jax.random.uniform(key, (L, d_in, R), jnp.float32, -bound, bound)
    if min(lora.ranks) < R:
        lora_a = lora_a * (jnp.arange(R)[None, None, :] < jnp.asarray(lora.ranks)[:, None, None])
    leaves = {"lora_a": lora_a, "lora_b": jnp.zeros((L, R, d_out), jnp.float32)}
    if method.dora:
        base = dequantize(kernel) if isinstance(kernel, QuantizedArray) else kernel
        leaves["magnitude"] = jnp.linalg.norm(base.astype(jnp.float32), axis=1)
    if method.lora_bias:
        leaves["lora_bias"] = jnp.zeros((L, d_out), jnp.float32)
    return leaves


def _expert_lora_leaves(kernel, rank: int, key) -> dict:
    """LoRA's leaves for an expert stack [L, E, in, out]: each expert's A (PEFT's ParamWrapper draws its lora_A
    [r E, in] kaiming-uniform, bound 1 / sqrt(in)) and B (zeros)."""
    L, E, d_in, d_out = full_shape(kernel)
    bound = 1 / math.sqrt(d_in)
    return {"lora_a": jax.random.uniform(key, (L, E, d_in, rank), jnp.float32, -bound, bound),
            "lora_b": jnp.zeros((L, E, rank, d_out), jnp.float32)}


def add_lora(params: dict, cfg: ModelConfig, method: LoRAConfig, key: jax.Array) -> dict:
    """`params` with LoRA's leaves on every module (and expert stack) `method` adapts."""
    layers = dict(params["layers"])
    keys = module_keys(key)
    for name, lora in lora_layout(method, cfg.layer_stacks()).items():
        layers[name] = {**layers[name], **_lora_leaves(layers[name]["kernel"], lora, method, keys[name])}
    if method.target_parameters and not cfg.num_experts:
        raise JaxtuneError(f"target_parameters {list(method.target_parameters)}: a {cfg.architecture} has no experts")
    for i, name in enumerate(method.expert_modules):
        experts = layers["experts"]
        rank, _ = method.expert_lora(name, cfg.module_layers("experts"))
        leaves = _expert_lora_leaves(experts[name]["kernel"], rank, jax.random.fold_in(key, 100 + i))
        layers["experts"] = {**experts, name: {**experts[name], **leaves}}
    return {**params, "layers": layers}


def quantize_base(params: dict, method: QLoRAConfig) -> dict:
    """The base tree with every linear kernel quantised for QLoRA (NF4 or int8), a mixture's experts too (each
    expert's matrix as one weight; the router stays in float)."""
    quantize = (lambda w: quantize_nf4(w, method.double_quant)) if method.bits == 4 else quantize_int8
    quantized = lambda m: m if isinstance(m["kernel"], QuantizedArray) else {**m, "kernel": quantize(m["kernel"])}
    layers = {**params["layers"], **{name: quantized(module) for name, module in params["layers"].items()
                                     if hf_module_name(name).rsplit(".", 1)[-1] in LINEAR_MODULE_NAMES}}
    if "experts" in layers:
        layers["experts"] = {name: quantized(m) for name, m in layers["experts"].items()}
    return {**params, "layers": layers}


def count(params: dict, method: LoRAConfig, stacks: Stacks) -> dict[str, int]:
    """{module: parameters PEFT creates for its LoRA} among `stacks` (`lora_layout`'s): per adapted layer r (in +
    out), + out for DoRA's magnitude and for lora_bias (the zero padding of smaller ranks is not a parameter)."""
    counts = {}
    for name, lora in lora_layout(method, stacks).items():
        module = params["layers"][name]
        d_in, d_out = module["lora_a"].shape[1], module["lora_b"].shape[2]
        counts[name] = sum(r * (d_in + d_out) + d_out * (method.dora + method.lora_bias) for r in lora.ranks if r)
    return counts


def _in_b_group(path, x) -> bool:
    """PEFT's `create_loraplus_optimizer` B groups: `lora_b` and every vector (one dimension per layer: a LoRA bias,
    DoRA's magnitude); not A nor the matrices trained whole (`modules_to_save`). PEFT's embedding group (LoRA on an
    embedding, `loraplus_lr_embedding`) has no counterpart: jaxtune adapts linear modules only."""
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return names[-1] == "lora_b" or x.ndim - ("layers" in names) == 1


def loraplus_rates(method: LoRAConfig, trainable: dict) -> dict | None:
    """LoRA+ (Hayou et al. 2024): the B group's learning rate (and with it its decoupled weight decay) at
    loraplus_lr_ratio x the rate, as PEFT's param groups give torch's optimizers; None when off."""
    ratio = method.loraplus_lr_ratio
    if not ratio:
        return None
    return jax.tree_util.tree_map_with_path(lambda path, x: ratio if _in_b_group(path, x) else 1.0, trainable)
