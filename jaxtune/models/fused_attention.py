"""The backends' fused attention kernels, used instead of the blockwise kernel (`attention.py`) where they cover the
mask of a full forward: Pallas splash attention on TPU (`splash_attention`), cuDNN's flash attention through
`jax.nn.dot_product_attention` on NVIDIA GPUs (`cudnn_attention`).

`choose_kernel` decides once per forward, from static facts (backend, shapes, dtype, what the mask is made of):
`splash_covers` and `cudnn_covers` say why a kernel cannot run (splash: sequence lengths in whole blocks, no prefix
keys with padding or packing; cuDNN: no prefix keys, packing or soft cap, 16-bit compute, its head sizes, padding
only on the right, checked per batch), else the blockwise kernel, always on CPU. A layer's sliding window is traced
and both kernels take it statically: each distinct window gets its kernel, switched per layer (`lax.switch`).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxtune.errors import ConfigError
from jaxtune.models.attention import AttentionMask
from jaxtune.parallel.rules import mesh_in_context, partition_spec, platform_in_context

LANES = 128  # splash's blocks are multiples of the TPU's 128 lanes


class FusedAttention(NamedTuple):
    """A forward's fused kernel, static under jit. kind: "splash" or "cudnn"; windows: the model's distinct
    sliding windows (0: none), each with its own kernel; masked: the batch has padding or packed segments;
    interpret: run splash's Pallas kernel in the interpreter (off TPU: tests)."""

    kind: str
    windows: tuple[int, ...]
    masked: bool = False
    interpret: bool = False


def splash_covers(T: int, S: int, prefix: int, masked: bool) -> str | None:
    """Why splash attention cannot run this forward, or None. masked: packed segments or padding present."""
    if T % LANES or S % LANES:
        return f"its blocks are multiples of {LANES} positions; the sequence has {T} queries and {S} keys"
    if prefix and masked:
        return "prefix keys seen by every packed segment or past padding cannot be written as segment ids"
    return None


def cudnn_covers(prefix: int, packed: bool, softcap: float | None, dtype, head_dim: int) -> str | None:
    """Why cuDNN's flash attention cannot run this forward (before the probe), or None."""
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


def choose_kernel(choice: str, *, B: int, T: int, S: int, K: int, G: int, head_dim: int, prefix: int, packed: bool,
                  padded: bool, softcap: float | None, dtype, windows: tuple[int, ...]) -> FusedAttention | None:
    """The fused kernel a full forward uses, or None for the blockwise kernel.

    choice: "auto" (the backend's kernel where it covers the mask), "blockwise", or "splash" / "cudnn": that kernel
    wherever it covers the mask, even off its backend for splash (interpreted: tests); a forward it cannot run
    (an eval batch of 64 tokens for splash, say) takes the blockwise kernel with a `FusedAttentionWarning` saying
    why. "cudnn" off a GPU is an error."""
    if choice == "blockwise":
        return None
    backend = platform_in_context()
    kind = {"auto": {"tpu": "splash", "gpu": "cudnn"}.get(backend), "splash": "splash", "cudnn": "cudnn"}[choice]
    if kind is None:
        return None
    if kind == "cudnn" and backend != "gpu":
        raise ConfigError("attention", choice, f"cuDNN runs on NVIDIA GPUs; this backend is {backend}")
    if kind == "splash":
        why = splash_covers(T, S, prefix, packed or padded)
    else:
        why = cudnn_covers(prefix, packed, softcap, dtype, head_dim) or _cudnn_refuses(B, T, K, G, head_dim, dtype,
                                                                                         windows)
    if why is None:
        return FusedAttention(kind, windows, packed or padded, interpret=kind == "splash" and backend != "tpu")
    if choice != "auto":
        _warn_once(f'attention = "{choice}": the blockwise kernel runs a forward {kind} cannot run: {why}')
    return None


class FusedAttentionWarning(UserWarning):
    """A fused attention kernel that was asked for could not run a forward."""


@functools.cache  # once a reason a process: a forward is traced for every batch shape
def _warn_once(message: str) -> None:
    warnings.warn(message, FusedAttentionWarning, stacklevel=4)


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


def _by_window(window: jax.Array, windows: tuple[int, ...], run_with):
    """run_with(w) for the static w in `windows` that equals the traced `window`."""
    if len(windows) == 1:
        return run_with(windows[0])
    index = jnp.argmax(jnp.asarray(windows, jnp.int32) == window)
    return jax.lax.switch(index, [lambda w=w: run_with(w) for w in windows])


def cudnn_attention(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, window: jax.Array, windows: tuple[int, ...], *, scale: float,
                    implementation: str = "cudnn") -> jax.Array:
    """Causal (sliding-window) attention [B, T, K, G, hd] through `jax.nn.dot_product_attention`: right padding
    needs no mask under causality (no real query sees a later pad). implementation "xla": the same call on any
    backend (tests)."""
    B, T, K, G, hd = q_BxTxKxGxh.shape
    q_BxTxNxh = q_BxTxKxGxh.reshape(B, T, K * G, hd)
    run = lambda w: _dot_product_attention(q_BxTxNxh, k_BxSxKxh, v_BxSxKxh, window=w, scale=scale,  # noqa: E731
                                           implementation=implementation)
    return _by_window(window, windows, run).reshape(B, T, K, G, hd)


def right_padded(mask: AttentionMask) -> jax.Array:
    """Scalar bool: in every row the valid keys come first (no key is valid after an invalid one)."""
    valid = mask.k_valid_BxS
    return jnp.all(valid[:, :-1] | ~valid[:, 1:])


def splash_block_sizes(T: int, S: int):
    """Splash's `BlockSizes` for T queries over S keys (both multiples of 128): the largest of 512, 256, 128 dividing
    each, the same in the forward and both backward kernels."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    block_q, block_kv = (next(b for b in (512, 256, LANES) if n % b == 0) for n in (T, S))
    return splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block_q,
                             block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                             block_kv_dq=block_kv)


def splash_attention(q_BxKxGxTxh, k_BxKxSxh, v_BxKxSxh, mask: AttentionMask, window: jax.Array,
                     kernel: FusedAttention, *, scale: float, softcap: float | None) -> jax.Array:
    """softmax(q k^T scale) v [B, K, G, T, hd] by Pallas splash attention, with the mask of the forward's P = S - T
    prefix keys, causality, the layer's window, and (kernel.masked) packed segments and padding as segment ids: a
    query carries its segment, a key its segment when valid and -2 (no query's) when padding. A query that sees no
    key (left padding) gets a finite output nobody reads, as in the blockwise kernel. On a mesh, each device runs
    the kernel on its rows and key/value heads (`shard_map`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, K, G, T, hd = q_BxKxGxTxh.shape
    S = k_BxKxSxh.shape[2]
    q_scaled = (q_BxKxGxTxh.astype(jnp.float32) * scale).astype(q_BxKxGxTxh.dtype)
    q_segment_BxT = mask.q_segment_BxT
    k_segment_BxS = jnp.where(mask.k_valid_BxS, mask.k_segment_BxS, -2)
    blocks = splash_block_sizes(T, S)

    def kernel_for(w: int):
        one = (masks.CausalMask((T, S), offset=S - T) if w == 0
               else masks.LocalMask((T, S), window_size=(w - 1, 0), offset=S - T))
        return splash.make_splash_mha(masks.MultiHeadMask([one] * (K * G)), head_shards=1, q_seq_shards=1,
                                      block_sizes=blocks, attn_logits_soft_cap=softcap, interpret=kernel.interpret)

    def rows(q, k, v, q_segment, k_segment, window):  # per device: [b, K', G, T, hd], [b, K', S, hd], [b, T], [b, S]
        b, k_heads = q.shape[:2]
        q_bxNxTxh = q.reshape(b, k_heads * G, T, hd)

        def run_with(w):
            call = kernel_for(w)
            if not kernel.masked:
                return jax.vmap(lambda q, k, v: call(q, k, v))(q_bxNxTxh, k, v)
            segments = splash.SegmentIds(q=q_segment, kv=k_segment)
            return jax.vmap(lambda q, k, v, s: call(q, k, v, segment_ids=s))(q_bxNxTxh, k, v, segments)

        return _by_window(window, kernel.windows, run_with).reshape(b, k_heads, G, T, hd)

    mesh = mesh_in_context()
    if mesh is None:
        return rows(q_scaled, k_BxKxSxh, v_BxKxSxh, q_segment_BxT, k_segment_BxS, window)
    row_spec, head_spec = partition_spec(("batch", "kv_heads"), (B, K), mesh.shape)
    heads = PartitionSpec(row_spec, head_spec)
    segments = PartitionSpec(row_spec)
    return jax.shard_map(rows, mesh=mesh, in_specs=(heads, heads, heads, segments, segments, PartitionSpec()),
                         out_specs=heads, check_vma=False)(q_scaled, k_BxKxSxh, v_BxKxSxh, q_segment_BxT,
                                                           k_segment_BxS, window)
