"""RMSNorm as transformers' families compute it (`rms_norm`): statistics in float32, the scale's product in the
input dtype, or in float32 for Gemma's (1 + weight) and OLMo's. Their ops are named in the scope "norm"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.models.linear import wide


@jax.named_scope("norm")
def rms_norm(x_BxTxD: jax.Array, weight_D: jax.Array, eps: float, unit_offset: bool = False,
             float32_scale: bool = False) -> jax.Array:
    """x / rms(x) * weight, the statistics in float32 (or wider), the product in the input dtype; with
    `unit_offset` (Gemma), x / rms(x) * (1 + weight) with the product in float32 before the cast; with
    `float32_scale` (OLMo), x / rms(x) * weight likewise."""
    x32 = x_BxTxD.astype(wide(x_BxTxD.dtype))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (x32 * (1 + weight_D.astype(x32.dtype))).astype(x_BxTxD.dtype)
    if float32_scale:
        return (x32 * weight_D.astype(x32.dtype)).astype(x_BxTxD.dtype)
    return weight_D.astype(x_BxTxD.dtype) * x32.astype(x_BxTxD.dtype)


@jax.named_scope("norm")
def unscaled_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis in float32 (or wider), no weight (Llama 4's query and key norm, Gemma 4's value
    and router norms)."""
    x32 = x.astype(wide(x.dtype))
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
