"""Splash attention over a full forward's queries (`splash_attention`): Pallas' kernel with the forward's mask (P
prefix keys, causality, the layer's window or chunks, packed segments and padding as segment ids) and attention
sinks, per device under `shard_map` on a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxtune.models.attention import AttentionMask
from jaxtune.models.kernels.base import FusedAttention, by_window
from jaxtune.models.kernels.splash.blocks import splash_block_sizes
from jaxtune.parallel.rules import mesh_in_context, partition_spec


def splash_attention(q_BxKxGxTxh, k_BxKxSxh, v_BxKxSxh, mask: AttentionMask, window: jax.Array,
                     kernel: FusedAttention, *, scale: float, softcap: float | None,
                     sinks_KxG: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T scale) v [B, K, G, T, hd] by Pallas splash attention, with the mask of the forward's P = S - T
    prefix keys, causality, the layer's window (w < 0: chunks of -w, with no prefix), the sinks [K, G] (splash's
    `sinks`, one a query head, against the scaled scores), and (kernel.masked) packed segments and padding as
    segment ids: a query carries its segment, a key its segment when valid and -2 (no query's) when padding. A query
    that sees no key (left padding) gets a finite output nobody reads, as in the blockwise kernel. On a mesh, each
    device runs the kernel on its rows and key/value heads (`shard_map`)."""
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
               else masks.ChunkedCausalMask((T, S), chunk_size=-w) if w < 0
               else masks.LocalMask((T, S), window_size=(w - 1, 0), offset=S - T))
        return splash.make_splash_mha(masks.MultiHeadMask([one] * (K * G)), head_shards=1, q_seq_shards=1,
                                      block_sizes=blocks, attn_logits_soft_cap=softcap, interpret=kernel.interpret)

    def rows(q, k, v, q_segment, k_segment, window, sinks):  # per device: [b, K', G, T, hd], [b, K', S, hd],
        b, k_heads = q.shape[:2]                             # [b, T], [b, S], [K', G] or None
        q_bxNxTxh = q.reshape(b, k_heads * G, T, hd)
        sinks_N = None if sinks is None else sinks.reshape(-1).astype(jnp.float32)

        def run_with(w):
            call = kernel_for(w)
            if not kernel.masked:
                return jax.vmap(lambda q, k, v: call(q, k, v, sinks=sinks_N))(q_bxNxTxh, k, v)
            segments = splash.SegmentIds(q=q_segment, kv=k_segment)
            return jax.vmap(lambda q, k, v, s: call(q, k, v, segment_ids=s, sinks=sinks_N))(q_bxNxTxh, k, v,
                                                                                             segments)

        return by_window(window, kernel.windows, run_with).reshape(b, k_heads, G, T, hd)

    mesh = mesh_in_context()
    if mesh is None:
        return rows(q_scaled, k_BxKxSxh, v_BxKxSxh, q_segment_BxT, k_segment_BxS, window, sinks_KxG)
    row_spec, head_spec = partition_spec(("batch", "kv_heads"), (B, K), mesh.shape)
    heads = PartitionSpec(row_spec, head_spec)
    segments = PartitionSpec(row_spec)
    sink_spec = None if sinks_KxG is None else PartitionSpec(head_spec)
    return jax.shard_map(rows, mesh=mesh, in_specs=(heads, heads, heads, segments, segments, PartitionSpec(),
                                                    sink_spec),
                         out_specs=heads, check_vma=False)(q_scaled, k_BxKxSxh, v_BxKxSxh, q_segment_BxT,
                                                           k_segment_BxS, window, sinks_KxG)
