"""Splash attention as the per-block kernel of a balanced context ring (`models/context_attention.py`), the unit's
`RingKernel`: a device's two chunks (i, 2N-1-i) over the step's key/value block, in three cases
(`_splash_case`), each a splash kernel over chunks of c tokens, its forward with the log-sum-exp the ring merges by
and its backward given the whole attention's output and lse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.models.kernels.base import RingCall
from jaxtune.models.kernels.splash.blocks import splash_block_sizes

NO_KEY = float(np.finfo(np.float32).min)  # the lse of queries that see no key of a block


def _splash_case(step, ways: int, axis: str):
    """Which part of the step's block a device's two chunks (i, 2N-1-i) see, the block coming from device
    j = i - step: 0, both chunks' own keys, causally (step 0); 1, j < i: every query sees the block's first chunk
    and not its second; 2, j > i: the second chunk's queries see the whole block, the first's nothing."""
    i = jax.lax.axis_index(axis)
    source = (i - step) % ways
    return jnp.where(step == 0, 0, jnp.where(source < i, 1, 2))


def _splash_kernels(c: int, heads: int, call: RingCall):
    """Splash kernels of the three cases of `_splash_case` over chunks of c tokens, for `heads` query heads (made
    where traced: a kernel holds its mask's arrays)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    def make(mask):
        return splash.make_splash_mha(masks.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=1,
                                      block_sizes=splash_block_sizes(*mask.shape), attn_logits_soft_cap=call.softcap,
                                      interpret=call.interpret)

    return make(masks.CausalMask((2 * c, 2 * c))), make(masks.FullMask((2 * c, c))), make(masks.FullMask((c, 2 * c)))


def _splash_parts(q, queries, keys, call: RingCall):
    """Per device: q scaled [b, H, 2c, hd], k and v [b, K', 2c, hd], segment ids (padding keys in none), c."""
    b, k_heads, G, T2, hd = q.shape
    q_scaled = (q.astype(jnp.float32) * call.scale).astype(q.dtype).reshape(b, k_heads * G, T2, hd)
    k, v, _, valid, k_segment = keys
    return q_scaled, k, v, queries[1], jnp.where(valid, k_segment, -2), T2 // 2


def ring_attend(q, queries, keys, step, call: RingCall):
    """One ring step's attention by splash: (out [b, K', G, 2c, hd], lse [b, K', G, 2c]) float32 of the step's block."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, k_heads, G, T2, hd = q.shape
    q_s, k, v, q_segment, k_segment, c = _splash_parts(q, queries, keys, call)
    kernels = _splash_kernels(c, k_heads * G, call)

    def run(kernel, q, k, v, q_segment, k_segment):
        kw = kernel.kwargs
        out, (lse,) = jax.vmap(lambda q, k, v, qs, ks: splash._splash_attention_forward(
            kernel.fwd_mask_info, q, k, v, splash.SegmentIds(q=qs, kv=ks), None, mask_value=kw["mask_value"],
            is_mqa=kw["is_mqa"], block_sizes=kw["block_sizes"], residual_checkpoint_name=None, save_residuals=True,
            mask_function=kw["mask_function"], attn_logits_soft_cap=kw["attn_logits_soft_cap"],
            interpret=kw["interpret"]))(q, k, v, q_segment, k_segment)
        return out.astype(jnp.float32), lse.astype(jnp.float32)

    def bottom():  # the second chunk's queries over the whole block; the first's see none of it
        out, lse = run(kernels[2], q_s[:, :, c:], k, v, q_segment[:, c:], k_segment)
        # (made inside the branch: made in the ring's loop body, a differentiated scan would stack a copy a step)
        return (jnp.concatenate([jnp.zeros_like(out), out], axis=2),
                jnp.concatenate([jnp.full_like(lse, NO_KEY), lse], axis=2))

    cases = [lambda: run(kernels[0], q_s, k, v, q_segment, k_segment),
             lambda: run(kernels[1], q_s, k[:, :, :c], v[:, :, :c], q_segment, k_segment[:, :c]), bottom]
    out, lse = jax.lax.switch(_splash_case(step, call.ways, call.axis), cases)
    return out.reshape(b, k_heads, G, T2, hd), lse.reshape(b, k_heads, G, T2)


def ring_grads(q, queries, keys, step, out, lse, g, call: RingCall):
    """One ring step's gradients by splash's backward kernels, given the whole attention's output and lse: (dq, dk,
    dv) float32."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, k_heads, G, T2, hd = q.shape
    H = k_heads * G
    q_s, k, v, q_segment, k_segment, c = _splash_parts(q, queries, keys, call)
    kernels = _splash_kernels(c, H, call)
    o, do, lse = out.reshape(b, H, T2, hd), g.astype(out.dtype).reshape(b, H, T2, hd), lse.reshape(b, H, T2)

    def run(kernel, q, k, v, q_segment, k_segment, o, do, lse):
        kw = kernel.kwargs

        def one(q, k, v, qs, ks, o, do, lse):
            residuals = (q, k, v, splash.SegmentIds(q=qs, kv=ks), None, o, lse, kernel.dq_mask_info,
                         kernel.dkv_mask_info)
            grads = splash._splash_attention_bwd(False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
                                                 kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"],
                                                 residuals, do)
            return grads[3:6]

        dq, dk, dv = jax.vmap(one)(q, k, v, q_segment, k_segment, o, do, lse)
        return dq.astype(jnp.float32) * call.scale, dk.astype(jnp.float32), dv.astype(jnp.float32)

    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731

    def left():  # every query over the block's first chunk
        dq, dk, dv = run(kernels[1], q_s, k[:, :, :c], v[:, :, :c], q_segment, k_segment[:, :c], o, do, lse)
        rest = zeros(b, k_heads, c, hd)
        return dq, jnp.concatenate([dk, rest], axis=2), jnp.concatenate([dv, rest], axis=2)

    def bottom():  # the second chunk's queries over the whole block
        dq, dk, dv = run(kernels[2], q_s[:, :, c:], k, v, q_segment[:, c:], k_segment, o[:, :, c:], do[:, :, c:],
                         lse[:, :, c:])
        return jnp.concatenate([zeros(b, H, c, hd), dq], axis=2), dk, dv

    cases = [lambda: run(kernels[0], q_s, k, v, q_segment, k_segment, o, do, lse), left, bottom]
    dq, dk, dv = jax.lax.switch(_splash_case(step, call.ways, call.axis), cases)
    return dq.reshape(b, k_heads, G, T2, hd), dk, dv
