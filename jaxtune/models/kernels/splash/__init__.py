"""Pallas splash attention, TPU's fused kernel (`SPLASH`): the mask of P = S - T prefix keys, causality, the layer's
window and, for packed rows or padding, segment ids, in blocks of 128 positions (`blocks.py`); off TPU (asked for) it
runs in Pallas' interpreter. A full forward's (`full.py`), and a context ring's per-block kernel (`ring.py`). The
planner counts no score blocks in HBM for it (they stay in VMEM) and its own blocks' dead pairs skipped
(experiments/tpu_compile_table.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.models.kernels.base import AttentionKernel, AttentionShape, KernelCall, KernelCosts, RingKernel
from jaxtune.models.kernels.splash.blocks import block_pair, splash_covers
from jaxtune.models.kernels.splash.full import splash_attention
from jaxtune.models.kernels.splash.ring import ring_attend, ring_grads


def _covers(shape: AttentionShape) -> str | None:
    if min(shape.windows) < 0 and shape.prefix:
        return "its chunked mask (Llama 4's) takes no prefix keys"
    return splash_covers(shape.T, shape.S, shape.prefix, shape.packed or shape.padded)


def _attend(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, call: KernelCall) -> jax.Array:
    q, k, v = jnp.transpose(q_BxTxKxGxh, (0, 2, 3, 1, 4)), *(jnp.transpose(a, (0, 2, 1, 3)) for a in (k_BxSxKxh,
                                                                                                   v_BxSxKxh))
    out = splash_attention(q, k, v, call.mask, call.window, call.fused, scale=call.scale, softcap=call.softcap,
                           sinks_KxG=call.sinks_KxG)
    return jnp.transpose(out, (0, 3, 1, 2, 4))


SPLASH = AttentionKernel("splash", platforms=("tpu",), covers=_covers, attend=_attend, off_platform="interpret",
                         ring=RingKernel(ring_attend, ring_grads),
                         costs=KernelCosts(workspace=lambda b, heads, T, S, itemsize: 0, blocks=block_pair, passes=3.5))
