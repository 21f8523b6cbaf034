"""cuDNN's flash attention on NVIDIA GPUs through `jax.nn.dot_product_attention` (`CUDNN`): causal (sliding-window)
attention, right for every row padded on the right; a batch with left padding takes the blockwise kernel (checked
per batch). It covers no prefix keys, packing, soft cap or attention sinks, 16-bit compute only, its head sizes; and
what cuDNN itself refuses (its version, the GPU) is found by tracing the call (`probe`). The planner counts it as the
blockwise kernel (not measured)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtune.models.attention import AttentionMask
from jaxtune.models.kernels.base import AttentionKernel, KernelCall, by_window


def cudnn_covers(prefix: int, packed: bool, softcap: float | None, dtype, head_dim: int, sinks: bool) -> str | None:
    """Why cuDNN's flash attention cannot run this forward (before the probe), or None."""
    if sinks:
        return "jax.nn.dot_product_attention takes no attention sinks"
    if prefix:
        return "prefix keys need a mask cuDNN's causal attention does not take"
    if packed:
        return "packed segments need a mask jax.nn.dot_product_attention does not take"
    if softcap:
        return "it does not soft-cap scores"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 compute, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 8 up to 256"
    return None


def _cudnn_refuses(B, T, K, G, head_dim, dtype, windows) -> str | None:
    """cuDNN's own refusal of these shapes (its version, the GPU, the head size), found by tracing the call."""
    q = jax.ShapeDtypeStruct((B, T, K * G, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((B, T, K, head_dim), dtype)
    try:
        for window in windows:
            call = functools.partial(_dot_product_attention, window=window, scale=1.0, implementation="cudnn")
            jax.eval_shape(jax.grad(lambda q, k, v: call(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)), q, kv, kv)
    except Exception as error:  # noqa: BLE001 — any refusal means the blockwise kernel runs instead
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def _dot_product_attention(q_BxTxNxh, k_BxSxKxh, v_BxSxKxh, *, window: int, scale: float, implementation: str):
    return jax.nn.dot_product_attention(q_BxTxNxh, k_BxSxKxh, v_BxSxKxh, scale=scale, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation=implementation)


def cudnn_attention(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, window: jax.Array, windows: tuple[int, ...], *, scale: float,
                    implementation: str = "cudnn") -> jax.Array:
    """Causal (sliding-window) attention [B, T, K, G, hd] through `jax.nn.dot_product_attention`: right padding
    needs no mask under causality (no real query sees a later pad). implementation "xla": the same call on any
    backend (tests)."""
    B, T, K, G, hd = q_BxTxKxGxh.shape
    q_BxTxNxh = q_BxTxKxGxh.reshape(B, T, K * G, hd)
    run = lambda w: _dot_product_attention(q_BxTxNxh, k_BxSxKxh, v_BxSxKxh, window=w, scale=scale,  # noqa: E731
                                           implementation=implementation)
    return by_window(window, windows, run).reshape(B, T, K, G, hd)


def right_padded(mask: AttentionMask) -> jax.Array:
    """Scalar bool: in every row the valid keys come first (no key is valid after an invalid one)."""
    valid = mask.k_valid_BxS
    return jnp.all(valid[:, :-1] | ~valid[:, 1:])


def _attend(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, call: KernelCall) -> jax.Array:
    fused = call.fused
    cudnn = lambda: cudnn_attention(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, call.window, fused.windows,  # noqa: E731
                                    scale=call.scale)
    return jax.lax.cond(right_padded(call.mask), cudnn, call.blockwise) if fused.masked else cudnn()


CUDNN = AttentionKernel(
    "cudnn", platforms=("gpu",),
    covers=lambda shape: "it has no chunked mask (Llama 4's)" if min(shape.windows) < 0 else cudnn_covers(
        shape.prefix, shape.packed, shape.softcap, shape.dtype, shape.head_dim, shape.sinks),
    probe=lambda shape: _cudnn_refuses(shape.B, shape.T, shape.K, shape.G, shape.head_dim, shape.dtype,
                                       shape.windows),
    attend=_attend, runs_on="cuDNN runs on NVIDIA GPUs")
