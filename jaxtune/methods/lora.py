"""Merging LoRA and DoRA into the base weights, and taking plain LoRA back out, as pure functions.

    merged = merge(params, method)          # kernels W + s A B (DoRA: m * (W + s A B) / ||W + s A B||)
    restored = unmerge(merged, adapters, method)   # W again, for LoRA (not DoRA: see below)

Merging dequantises QLoRA kernels: the merged model is a plain float model, as PEFT's `merge_and_unload` gives.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxtune.config import MethodConfig
from jaxtune.config.targets import lora_layout
from jaxtune.errors import JaxtuneError
from jaxtune.models.linear import dora_scale, kernel_of

LORA_LEAVES = ("lora_a", "lora_b", "magnitude", "lora_bias")


def module_scales(method: MethodConfig, name: str, num_layers: int) -> jnp.ndarray:
    """[L]: module `name`'s LoRA scale per layer (0 where the layer is not adapted), float32 (float64 with x64)."""
    return jnp.asarray(lora_layout(method, num_layers)[name].scales)


def _delta(module: dict, scale_L) -> jnp.ndarray:
    """s A B per layer, [L, in, out] float32."""
    ab = jnp.einsum("lir,lro->lio", module["lora_a"].astype(jnp.float32), module["lora_b"].astype(jnp.float32))
    return scale_L[:, None, None] * ab


def merge(params: dict, method: MethodConfig, dtype=None) -> dict:
    """The tree with every LoRA/DoRA module folded into its kernel and the adapter leaves removed.

    dtype: of the merged kernels (default: the base kernel's dtype, the original dtype for quantised ones).
    A LoRA bias (`lora_bias`) folds into the module's bias, s b; a module without a bias cannot take it (PEFT
    refuses that merge too).
    """
    layers = dict(params["layers"])
    for name, module in params["layers"].items():
        if not isinstance(module, dict) or "lora_a" not in module:
            continue
        scale_L = module_scales(method, name, module["lora_a"].shape[0])
        base = kernel_of(module, jnp.float32)
        out_dtype = dtype or module["kernel"].dtype
        merged = base + _delta(module, scale_L)
        if "magnitude" in module:
            scale = dora_scale(base, module["lora_a"], module["lora_b"], module["magnitude"], scale_L[:, None, None])
            merged = merged * jnp.where(scale_L[:, None] > 0, scale, 1.0)[:, None, :]
        merged_module = {k: v for k, v in module.items() if k not in LORA_LEAVES} | {"kernel": merged.astype(out_dtype)}
        if "lora_bias" in module:
            if "bias" not in module:
                raise JaxtuneError(f"{name}: a LoRA bias (lora_bias) cannot be merged into a module without a bias")
            bias = module["bias"].astype(jnp.float32) + scale_L[:, None] * module["lora_bias"].astype(jnp.float32)
            merged_module["bias"] = bias.astype(module["bias"].dtype)
        layers[name] = merged_module
    return {**params, "layers": layers}


def unmerge(merged: dict, adapters: dict, method: MethodConfig) -> dict:
    """Inverse of `merge` for LoRA: kernels W' - s A B, with `adapters`' LoRA leaves put back.

    `adapters` is any tree holding the LoRA leaves (e.g. the trainable half of `partition`). DoRA cannot be
    unmerged from the merged weights alone (the norm ||W + s A B|| is lost), so it is refused.
    """
    if method.dora:
        raise ValueError("DoRA cannot be unmerged from merged weights: the column norms of W + sAB are not kept")
    if method.lora_bias:
        raise ValueError("a LoRA bias cannot be unmerged from merged weights: the base bias is not kept")
    layers = dict(merged["layers"])
    for name, module in adapters["layers"].items():
        if not isinstance(module, dict) or module.get("lora_a") is None:
            continue
        lora = {k: module[k] for k in ("lora_a", "lora_b")}
        kernel = layers[name]["kernel"]
        restored = kernel.astype(jnp.float32) - _delta(lora, module_scales(method, name, lora["lora_a"].shape[0]))
        layers[name] = {**layers[name], **lora, "kernel": restored.astype(kernel.dtype)}
    return {**merged, "layers": layers}
