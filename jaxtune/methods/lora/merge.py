"""LoRA merged into its base: `merge` folds s B A (DoRA: rescaled) into the kernels, dequantising QLoRA's (a plain
float model, as PEFT's `merge_and_unload`); `merged_layer` does it a layer at a time for a merged export; `unmerge`
takes plain LoRA out again."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.lora.layout import module_scales
from jaxtune.methods.lora.leaves import LORA_LEAVES
from jaxtune.methods.lora.options import LoRAConfig
from jaxtune.methods.lora.product import dora_scale
from jaxtune.models.linear import kernel_of
from jaxtune.models.quant import BitPattern, QuantizedArray


def _delta(module: dict, scale_L) -> jnp.ndarray:
    """s A B per layer, [L, in, out] float32."""
    ab = jnp.einsum("lir,lro->lio", module["lora_a"].astype(jnp.float32), module["lora_b"].astype(jnp.float32))
    return scale_L[:, None, None] * ab


def _merged(module: dict, scale_L: jnp.ndarray, name: str, dtype=None) -> dict:
    """One module's leaves with its LoRA/DoRA folded in, for any number of stacked layers L (scale_L [L])."""
    base = kernel_of(module, jnp.float32)
    merged = base + _delta(module, scale_L)
    if "magnitude" in module:
        scale = dora_scale(base, module["lora_a"], module["lora_b"], module["magnitude"], scale_L[:, None, None])
        merged = merged * jnp.where(scale_L[:, None] > 0, scale, 1.0)[:, None, :]
    out = {k: v for k, v in module.items() if k not in LORA_LEAVES} | {"kernel": merged.astype(dtype or
                                                                                           module["kernel"].dtype)}
    if "lora_bias" in module:
        if "bias" not in module:
            raise JaxtuneError(f"{name}: a LoRA bias (lora_bias) cannot be merged into a module without a bias")
        bias = module["bias"].astype(jnp.float32) + scale_L[:, None] * module["lora_bias"].astype(jnp.float32)
        out["bias"] = bias.astype(module["bias"].dtype)
    return out


def _merged_experts(module: dict, scale: float, dtype=None) -> dict:
    """An expert stack [..., E, in, out] with each expert's LoRA folded in: W_e + s A_e B_e (its bias kept)."""
    base = kernel_of(module, jnp.float32)
    if "lora_a" in module:
        base = base + scale * jnp.einsum("...ir,...ro->...io", module["lora_a"].astype(jnp.float32),
                                         module["lora_b"].astype(jnp.float32))
    return {**({"bias": module["bias"]} if "bias" in module else {}),
            "kernel": base.astype(dtype or module["kernel"].dtype)}


def _expert_scale(method: LoRAConfig, name: str, module: dict, cfg: ModelConfig | None) -> float:
    """Expert stack `name`'s LoRA scale (1 when it has no LoRA: nothing to fold) over `cfg`'s mixture layers (None:
    every row of the stack)."""
    if "lora_a" not in module:
        return 1.0
    return method.expert_lora(name, tuple(range(module["lora_a"].shape[0])) if cfg is None
                              else cfg.module_layers("experts"))[1]


def _scales(method: LoRAConfig, name: str, module: dict, cfg: ModelConfig | None) -> jax.Array:
    """[L] module `name`'s LoRA scales over the layers holding it (`cfg`'s; None: every layer of the stack)."""
    return module_scales(method, name, tuple(range(module["lora_a"].shape[0])) if cfg is None
                         else cfg.module_layers(name))


def merge(params: dict, method: LoRAConfig, dtype=None, cfg: ModelConfig | None = None) -> dict:
    """The tree with every LoRA/DoRA module folded into its kernel and the adapter leaves removed (and every
    quantised kernel dequantised, every kernel held as a bit pattern bitcast back).

    dtype: of the merged kernels (default: the base kernel's dtype, the original dtype for quantised ones).
    A LoRA bias (`lora_bias`) folds into the module's bias, s b; a module without a bias cannot take it (PEFT
    refuses that merge too). For writing a merged model, `merged_layer` does the same one layer at a time.
    """
    layers = dict(params["layers"])
    for name, module in params["layers"].items():
        if name == "experts":
            layers[name] = {m: _merged_experts(e, _expert_scale(method, m, e, cfg), dtype) for m, e in module.items()}
        elif isinstance(module, dict) and "lora_a" in module:
            layers[name] = _merged(module, _scales(method, name, module, cfg), name, dtype)
        elif isinstance(module, dict) and isinstance(module.get("kernel"), QuantizedArray | BitPattern):  # not adapted
            layers[name] = {**module, "kernel": kernel_of(module, dtype or module["kernel"].dtype)}
    return {**params, "layers": layers}


def merged_layer(params: dict, method: LoRAConfig, cfg: ModelConfig | None = None):
    """`tensor(path, layer)` for `save_model`: layer `layer` of leaf `path` of `merge(params, method)`, computed
    alone (a merged export then never holds the merged model beside the adapted one); None for leaves merging
    leaves as they are."""
    merge_one = jax.jit(_merged, static_argnums=(2,))
    merge_experts = jax.jit(_merged_experts, static_argnums=(1,))

    def tensor(path: tuple[str, ...], layer: int):
        if path[:2] == ("layers", "experts"):
            module = params["layers"]["experts"][path[2]]
            if "lora_a" not in module:
                return None
            return merge_experts(jax.tree.map(lambda x: x[layer], module),
                                 _expert_scale(method, path[2], module, cfg))["kernel"]
        module = params["layers"].get(path[1]) if path[0] == "layers" and len(path) == 3 else None
        if not isinstance(module, dict) or "lora_a" not in module:
            return None
        scale = _scales(method, path[1], module, cfg)[layer:layer + 1]
        one = jax.tree.map(lambda x: x[layer:layer + 1], module)
        return merge_one(one, scale, path[1])[path[2]][0]

    return tensor


def unmerge(merged: dict, adapters: dict, method: LoRAConfig, cfg: ModelConfig | None = None) -> dict:
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
        restored = kernel.astype(jnp.float32) - _delta(lora, _scales(method, name, lora, cfg))
        layers[name] = {**layers[name], **lora, "kernel": restored.astype(kernel.dtype)}
    return {**merged, "layers": layers}
