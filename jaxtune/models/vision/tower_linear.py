"""The one linear layer of the vision towers and projectors (`tower_linear`): a module's `kernel` [in, out], optional
`bias` [out], and where the method trains the tower with LoRA its `lora_a` [in, r], `lora_b` [r, out] and `lora_scale`
[] (alpha / r, put there by `methods.vision.with_lora_scales` before the tower runs). PEFT's `lora.Linear` order:
the base layer's output, bias included, plus the scaled branch."""

from __future__ import annotations

import jax

from jaxtune.models.linear import scaled


def tower_linear(x: jax.Array, module: dict) -> jax.Array:
    """[..., out] in x's dtype: x [..., in] @ kernel + bias, + lora_scale (x @ lora_a) @ lora_b where adapted."""
    y = x @ module["kernel"].astype(x.dtype)
    if "bias" in module:
        y = y + module["bias"].astype(x.dtype)
    if "lora_a" in module:
        branch = (x @ module["lora_a"].astype(x.dtype)) @ module["lora_b"].astype(x.dtype)
        y = y + scaled(branch, module["lora_scale"])
    return y
