"""Losses. Each returns sums and counts, not means, so that micro-batches and eval batches add up exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_nll(logits_BxTxV: jax.Array, labels_BxT: jax.Array) -> jax.Array:
    """-log p(label) per position [B, T], in float32."""
    logits = logits_BxTxV.astype(jnp.float32)
    label_logit = jnp.take_along_axis(logits, labels_BxT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logit


def masked_nll_sum(logits_BxTxV: jax.Array, labels_BxT: jax.Array, loss_mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of -log p over masked positions, number of masked positions). The mean is their ratio."""
    mask = loss_mask_BxT.astype(jnp.float32)
    return jnp.sum(token_nll(logits_BxTxV, labels_BxT) * mask), jnp.sum(mask)
