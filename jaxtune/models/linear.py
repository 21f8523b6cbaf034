"""The one linear layer every projection goes through, whatever method has transformed its leaves.

A module is a dict of one layer's leaves: `kernel` [in, out] (a float array or a quantised leaf), optional `bias`
[out], and the leaves methods add: `lora_a` [in, r] and `lora_b` [r, out] (LoRA), `magnitude` [out] (DoRA),
`ia3_in` [in] or `ia3_out` [out] (IA3). Dispatch is on which leaves are present, so a method is only a change
of the tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.methods.quant import QuantizedArray, dequantize


def kernel_of(module: dict, dtype) -> jax.Array:
    """The module's base weight [in, out] in `dtype`, dequantised inside the jitted computation if quantised."""
    kernel = module["kernel"]
    if isinstance(kernel, QuantizedArray):
        kernel = dequantize(kernel)
    return kernel.astype(dtype)


def dora_scale(kernel_IxO: jax.Array, lora_a: jax.Array, lora_b: jax.Array, magnitude_O: jax.Array,
               lora_scale: float) -> jax.Array:
    """DoRA's magnitude / ||W + s B A|| per output unit, the norm treated as a constant (DoRA paper, section 4.3)."""
    merged = kernel_IxO.astype(jnp.float32) + lora_scale * (lora_a.astype(jnp.float32) @ lora_b.astype(jnp.float32))
    norm_O = jax.lax.stop_gradient(jnp.linalg.norm(merged, axis=-2))
    return magnitude_O.astype(jnp.float32) / norm_O


def dense(x: jax.Array, module: dict, lora_scale: float = 1.0) -> jax.Array:
    """y = x @ W (+ LoRA, DoRA, IA3) (+ bias), in x's dtype.

    A quantised kernel is dequantised again in the backward pass rather than kept: the backward needs W for
    x's gradient, and keeping every layer's dequantised W would hold a float copy of the whole frozen model.
    """
    if isinstance(module["kernel"], QuantizedArray):
        return jax.checkpoint(_dense, static_argnums=2)(x, module, lora_scale)
    return _dense(x, module, lora_scale)


def _dense(x: jax.Array, module: dict, lora_scale: float) -> jax.Array:
    if "ia3_in" in module:
        x = x * module["ia3_in"].astype(x.dtype)
    kernel = kernel_of(module, x.dtype)
    y = x @ kernel
    if "lora_a" in module:
        lora_y = (x @ module["lora_a"].astype(x.dtype)) @ module["lora_b"].astype(x.dtype) * lora_scale
        y = y + lora_y
        if "magnitude" in module:
            scale = dora_scale(kernel, module["lora_a"], module["lora_b"], module["magnitude"], lora_scale)
            y = y * scale.astype(x.dtype)
    if "bias" in module:
        y = y + module["bias"].astype(x.dtype)
    if "ia3_out" in module:
        y = y * module["ia3_out"].astype(x.dtype)
    return y
