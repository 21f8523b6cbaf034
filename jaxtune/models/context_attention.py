"""Attention across a `context` mesh axis: each of its N devices holds T / N of every row's tokens through the step.
Layout (`context_layout`): with a global-attention layer, rows are load-balanced, device i holding chunks i and
2N-1-i of 2N (`spread_inputs`; `gather_outputs` restores the order with two `ppermute`s); with a window on every
layer, chunks stay contiguous and the ring stops at the last device a window reaches. "ring": key/value blocks
(with their slots, validity, segments) travel the ring by `ppermute` while each device attends to the block it
holds (blockwise, or a fused kernel's ring form: `with_ring_kernel`), merging by log-sum-exp; the backward passes
each block's gradient one hop behind it. "all_gather": each layer's keys and values gathered, gradients
reduce-scattered. Prefix keys are on every device; masked-out blocks are skipped. Each strategy is a `custom_vjp`;
sinks join each query's denominator once, after its blocks are merged (`attention.join_sinks`, `sink_grads`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec

from jaxtune.errors import JaxtuneError
from jaxtune.models.attention import (
    AttentionMask,
    attend_blocks,
    attention_grads,
    join_sinks,
    live_blocks,
    sink_grads,
)
from jaxtune.models.kernels import KERNELS, AttentionShape, FusedAttention, RingCall, RingKernel, choose_kernel
from jaxtune.parallel.rules import context_ways, mesh_in_context, partition_spec, platform_in_context

AXIS = "context"


class ContextLayout(NamedTuple):
    """How a forward's tokens lie on the context axis; static under jit.

    ways: N, the devices sharing a row. balanced: device i holds chunks i and 2N-1-i of 2N (else chunk i of N).
    strategy: "ring" or "all_gather". ring_steps: key/value blocks a device attends to (N, or fewer when every
    layer's window ends within the previous devices' chunks). fused: the balanced ring's per-block kernel, a fused
    one's ring form (`kernels.choose_kernel` picked it; `AttentionKernel.ring`), else the blockwise one."""

    ways: int
    balanced: bool
    strategy: str
    ring_steps: int
    fused: FusedAttention | None = None


def context_layout(T: int, sliding_windows: tuple[int, ...], strategy: str) -> ContextLayout | None:
    """The layout of rows of T tokens on the mesh in context, or None without a context axis. A model with a
    global layer (window 0) is balanced; else the ring is cut to the devices the widest window reaches."""
    ways = context_ways()
    if ways == 1:
        return None
    if min(sliding_windows) < 0:
        raise JaxtuneError("a context axis with chunked attention (Llama 4's) is not supported: context=1")
    balanced = 0 in sliding_windows
    chunk = padded_length(T, ways) // ways
    steps = ways if balanced else min(ways, 1 + -(-(max(sliding_windows) - 1) // chunk))
    return ContextLayout(ways, balanced, strategy, steps)


def with_ring_kernel(layout: ContextLayout | None, choice: str, *, B: int, T: int, K: int, G: int, head_dim: int,
                     prefix: int, softcap: float | None, dtype, windows: tuple[int, ...]) -> ContextLayout | None:
    """`layout` with a fused kernel as the ring's per-block kernel where `[model] attention` picks it for a device's
    chunks (`kernels.choose_kernel`) and it has a ring form: a balanced ring without prefix keys or windows; else the
    blockwise kernel (also for the all-gather strategy). A ring's per-block kernel never sees the sinks (joined
    after the merge; its backward takes the lse that holds them), so it is chosen as for a model without them."""
    if layout is None or not layout.balanced or layout.strategy != "ring" or prefix or set(windows) != {0}:
        return layout
    c = padded_length(T, layout.ways) // (2 * layout.ways)
    fused = choose_kernel(choice, AttentionShape(B, c, c, K, G, head_dim, 0, True, True, softcap, dtype, (0,), False),
                          platform_in_context())
    return layout if fused is None or KERNELS[fused.kind].ring is None else layout._replace(fused=fused)


def padded_length(T: int, ways: int) -> int:
    """T rounded up to whole chunks: a multiple of 2N."""
    return -(-T // (2 * ways)) * 2 * ways


def balanced_order(ways: int) -> np.ndarray:
    """The 2N chunks in the order the devices hold them: [0, 2N-1, 1, 2N-2, ..., N-1, N]."""
    return np.stack([np.arange(ways), 2 * ways - 1 - np.arange(ways)], axis=1).reshape(-1)


def to_layout(x: jax.Array, layout: ContextLayout, axis: int = 1) -> jax.Array:
    """x with its token axis (of length T, a multiple of 2N) in the layout's order."""
    if not layout.balanced:
        return x
    T = x.shape[axis]
    chunks = x.reshape(x.shape[:axis] + (2 * layout.ways, T // (2 * layout.ways)) + x.shape[axis + 1:])
    return jnp.take(chunks, balanced_order(layout.ways), axis=axis).reshape(x.shape)


def spread_inputs(layout: ContextLayout, tokens_BxT, positions_BxT, attention_mask_BxT, segment_ids_BxT, prefix: int):
    """(tokens, positions, attention mask, segment ids or None, slots [T']) padded to T' (`padded_length`; the
    padding is masked out) and in the layout's order; slots are each token's original slot, P + t."""
    B, T = tokens_BxT.shape
    pad = padded_length(T, layout.ways) - T
    if attention_mask_BxT is None and segment_ids_BxT is None and pad:  # else padding is segment 0, seen by none
        attention_mask_BxT = jnp.ones((B, T), jnp.int32)
    widen = lambda a: None if a is None else jnp.pad(a, ((0, 0), (0, pad)))  # noqa: E731
    arrays = [widen(a) for a in (tokens_BxT, positions_BxT, attention_mask_BxT, segment_ids_BxT)]
    slots = prefix + jnp.arange(T + pad, dtype=jnp.int32)
    return (*(None if a is None else to_layout(a, layout) for a in arrays), to_layout(slots, layout, axis=0))


def gather_outputs(x_BxTxD: jax.Array, layout: ContextLayout, T: int) -> jax.Array:
    """Hidden states [B, T', D] in the layout's order back in the rows' order, cut to T tokens. Balanced, each
    device holds one even and one odd chunk and sends each to the device that holds it in order: two `ppermute`s."""
    if layout.balanced:
        ways, mesh = layout.ways, mesh_in_context()
        spec = partition_spec(("batch", "seq", None), x_BxTxD.shape, mesh.shape)
        owner = lambda chunk: chunk // 2  # noqa: E731
        held = [(i, 2 * ways - 1 - i) for i in range(ways)]  # device i's chunks, in its order
        even = [(i, owner(a if a % 2 == 0 else b)) for i, (a, b) in enumerate(held)]
        odd = [(i, owner(b if a % 2 == 0 else a)) for i, (a, b) in enumerate(held)]

        def reorder(x):  # per device: [b, 2c, D], its chunks (i, 2N-1-i) -> (2j, 2j+1)
            first, second = jnp.split(x, 2, axis=1)
            i_even = jax.lax.axis_index(AXIS) % 2 == 0
            mine_even, mine_odd = jnp.where(i_even, first, second), jnp.where(i_even, second, first)
            return jnp.concatenate([jax.lax.ppermute(mine_even, AXIS, even),
                                    jax.lax.ppermute(mine_odd, AXIS, odd)], axis=1)

        x_BxTxD = jax.shard_map(reorder, mesh=mesh, in_specs=spec, out_specs=spec)(x_BxTxD)
    return x_BxTxD[:, :T]


class _Call(NamedTuple):
    """The static half of one context-attention call."""

    layout: ContextLayout
    scale: float
    softcap: float | None
    mesh: AbstractMesh
    q: PartitionSpec  # [B, K, G, T, hd]; the others follow from it


def context_attention(q_BxKxGxTxh, k_BxKxTxh, v_BxKxTxh, prefix_k_BxKxPxh, prefix_v_BxKxPxh, mask: AttentionMask,
                      window, layout: ContextLayout, *, scale: float, softcap: float | None,
                      sinks_KxG: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T scale) v [B, K, G, T, hd] of a context-split forward: q, k, v with tokens in the layout's order
    (split over the context axis), P prefix keys and values (P may be 0) held whole, and `mask` the tokens' own
    (`training_mask` without prefix: slots, validity, segments). sinks_KxG: attention sinks [K, G]
    (`attention.blockwise_attention`), or None."""
    mesh = mesh_in_context()
    spec = partition_spec(("batch", "kv_heads", None, "seq", None), q_BxKxGxTxh.shape, mesh.shape)
    if spec[3] != AXIS:
        raise ValueError(f"{q_BxKxGxTxh.shape[3]} tokens do not split over context = {layout.ways}")
    call = _Call(layout, float(scale), float(softcap) if softcap else None, mesh, spec)
    return _context_attention(q_BxKxGxTxh, k_BxKxTxh, v_BxKxTxh, prefix_k_BxKxPxh, prefix_v_BxKxPxh,
                              mask.q_slot_T, mask.k_valid_BxS, mask.q_segment_BxT, jnp.asarray(window, jnp.int32),
                              sinks_KxG, call)


def _specs(call: _Call):
    """in_specs of (q, k, v, prefix k, prefix v, slots, valid, segments, window, sinks) and the lse's spec."""
    rows, heads, _, seq, _ = call.q
    kv, prefix, tokens = PartitionSpec(rows, heads, seq, None), PartitionSpec(rows, heads, None, None), \
        PartitionSpec(rows, seq)
    return (call.q, kv, kv, prefix, prefix, PartitionSpec(seq), tokens, tokens, PartitionSpec(),
            PartitionSpec(heads, None)), PartitionSpec(rows, heads, None, seq)


def _pass(tree, ways: int, shift: int = 1):
    """Every device's `tree` sent `shift` devices on around the ring."""
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, [(i, (i + shift) % ways) for i in range(ways)]), tree)


def _gather(keys):
    """The key parts (k, v, slots, valid, segments) of every device, in device order."""
    k, v, slots, valid, segment = keys
    gather = lambda x, axis: jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)  # noqa: E731
    return gather(k, 2), gather(v, 2), gather(slots, 0), gather(valid, 1), gather(segment, 1)


def _with_prefix(keys, prefix_k, prefix_v):
    """The key parts with the P prefix keys first (slots 0..P-1, valid, seen by every segment)."""
    P = prefix_k.shape[2]
    if P == 0:
        return keys
    k, v, slots, valid, segment = keys
    b = valid.shape[0]
    return (jnp.concatenate([prefix_k, k], axis=2), jnp.concatenate([prefix_v, v], axis=2),
            jnp.concatenate([jnp.arange(P, dtype=slots.dtype), slots]),
            jnp.concatenate([jnp.ones((b, P), bool), valid], axis=1),
            jnp.concatenate([jnp.full((b, P), -1, segment.dtype), segment], axis=1))


def _mask(queries, keys) -> AttentionMask:
    q_slot, q_segment = queries
    _, _, k_slot, k_valid, k_segment = keys
    return AttentionMask(q_slot, k_valid, q_segment, k_segment, k_slot)


def _ring_call(call: _Call, fused: FusedAttention) -> RingCall:
    return RingCall(call.layout.ways, AXIS, call.scale, call.softcap, fused.interpret)


def _ring(fused: FusedAttention) -> RingKernel:
    ring = KERNELS[fused.kind].ring
    assert ring is not None  # `with_ring_kernel` sets a fused kernel only with its ring form
    return ring


def _attend(q, queries, keys, window, call: _Call, step=0):
    """(out, lse) of q over one key block, the ring's `step`-th (its kernel: a fused one's ring form, or blockwise)."""
    fused = call.layout.fused
    if fused is not None:
        return _ring(fused).attend(q, queries, keys, step, _ring_call(call, fused))
    mask = _mask(queries, keys)
    live = live_blocks(mask, q.shape[3], keys[0].shape[2])
    return attend_blocks(q, keys[0], keys[1], mask, window, live, call.scale, call.softcap)


def _grads(q, queries, keys, window, out, lse, g, call: _Call, step=0):
    fused = call.layout.fused
    if fused is not None:
        return _ring(fused).grads(q, queries, keys, step, out, lse, g, _ring_call(call, fused))
    mask = _mask(queries, keys)
    live = live_blocks(mask, q.shape[3], keys[0].shape[2])
    return attention_grads(q, keys[0], keys[1], mask, window, live, out, lse, g, call.scale, call.softcap)


def _one_from(x):
    """int32 1 computed from x: a ring's step counter that a differentiated scan keeps inside its loop."""
    return x.ravel()[0].astype(jnp.int32) * 0 + 1


def _forward_on_device(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, sinks_KxG, call: _Call):
    """(out in q's dtype, lse) of one device's queries over every device's keys and the sinks (if any)."""
    out, lse = _attend_every_block(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, call)
    if sinks_KxG is not None:
        out, lse = join_sinks(out, lse, sinks_KxG)
    return out.astype(q.dtype), lse


def _attend_every_block(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, call: _Call):
    """(out, lse) float32 of one device's queries over every device's keys, the blocks merged by log-sum-exp."""
    queries, keys = (slots, segment), (k, v, slots, (valid > 0), segment)
    if call.layout.strategy == "all_gather":
        return _attend(q, queries, _with_prefix(_gather(keys), prefix_k, prefix_v), window, call)
    out, lse = _attend(q, queries, _with_prefix(keys, prefix_k, prefix_v), window, call)
    steps, ways = call.layout.ring_steps, call.layout.ways
    if steps == 1:
        return out, lse

    def merge(out, lse, current, j):
        out_j, lse_j = _attend(q, queries, current, window, call, j)
        merged = jnp.logaddexp(lse, lse_j)
        return out * jnp.exp(lse - merged)[..., None] + out_j * jnp.exp(lse_j - merged)[..., None], merged

    def step(carry, _):  # the next block travels while this one is computed: nothing orders the two
        out, lse, current, j = carry
        ahead = _pass(current, ways)
        return (*merge(out, lse, current, j), ahead, j + 1), None

    # (the step counter is carried, not scanned over: a splash kernel's case known per step would be split out of
    # the loop by a differentiated scan, with the constants of its branches stacked a step each)
    (out, lse, last, _), _ = jax.lax.scan(step, (out, lse, _pass(keys, ways), _one_from(lse)), None, length=steps - 2)
    return merge(out, lse, last, steps - 1)


def _backward_on_device(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, out, lse, g, call: _Call):
    """(dq, dk, dv, d prefix k, d prefix v) of one device's share, in the inputs' dtypes (any sinks reach them only
    through lse). In the ring, each key block's float32 gradient travels one hop behind the block, gathering every
    device's share, and goes home."""
    P, ways, steps = prefix_k.shape[2], call.layout.ways, call.layout.ring_steps
    queries, keys = (slots, segment), (k, v, slots, (valid > 0), segment)
    if call.layout.strategy == "all_gather":
        dq, dk, dv = _grads(q, queries, _with_prefix(_gather(keys), prefix_k, prefix_v), window, out, lse, g, call)
        d_prefix = (dk[:, :, :P], dv[:, :, :P])
        dk, dv = (jax.lax.psum_scatter(d[:, :, P:], AXIS, scatter_dimension=2, tiled=True) for d in (dk, dv))
    else:
        dq, dk, dv = _grads(q, queries, _with_prefix(keys, prefix_k, prefix_v), window, out, lse, g, call)
        d_prefix, dk, dv = (dk[:, :, :P], dv[:, :, :P]), dk[:, :, P:], dv[:, :, P:]
        if steps > 1:
            def accumulate(dq, carried, current, j):
                dq_j, dk_j, dv_j = _grads(q, queries, current, window, out, lse, g, call, j)
                return dq + dq_j, _pass((carried[0] + dk_j, carried[1] + dv_j), ways)

            def step(carry, _):
                dq, carried, current, j = carry
                ahead = _pass(current, ways)
                return (*accumulate(dq, carried, current, j), ahead, j + 1), None

            init = (dq, _pass((dk, dv), ways), _pass(keys, ways), _one_from(dq))
            (dq, carried, last, _), _ = jax.lax.scan(step, init, None, length=steps - 2)
            dq, (dk, dv) = accumulate(dq, carried, last, steps - 1)
            if steps % ways:  # each block's gradient went `steps` hops on from its device: back home
                dk, dv = _pass((dk, dv), ways, shift=-steps)
    d_prefix = jax.lax.psum(d_prefix, AXIS)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            d_prefix[0].astype(prefix_k.dtype), d_prefix[1].astype(prefix_v.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(10,))
def _context_attention(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, sinks_KxG, call: _Call):
    return _context_attention_fwd(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, sinks_KxG, call)[0]


def _context_attention_fwd(q, k, v, prefix_k, prefix_v, slots, valid, segment, window, sinks_KxG, call: _Call):
    in_specs, lse_spec = _specs(call)
    out, lse = jax.shard_map(partial(_forward_on_device, call=call), mesh=call.mesh, in_specs=in_specs,
                             out_specs=(call.q, lse_spec), check_vma=False)(
        q, k, v, prefix_k, prefix_v, slots, valid, segment, window, sinks_KxG)
    return out, (q, k, v, prefix_k, prefix_v, slots, valid, segment, window, sinks_KxG, out, lse)


def _context_attention_bwd(call: _Call, residuals, g):
    in_specs, lse_spec = _specs(call)
    *inputs, sinks_KxG, out, lse = residuals
    grads = jax.shard_map(partial(_backward_on_device, call=call), mesh=call.mesh,
                          in_specs=in_specs[:9] + (call.q, lse_spec, call.q), out_specs=in_specs[:5],
                          check_vma=False)(*inputs, out, lse, g)
    # the sinks' gradient once, over every device's queries (a sum the partitioner splits)
    d_sinks = None if sinks_KxG is None else sink_grads(sinks_KxG, out, lse, g).astype(sinks_KxG.dtype)
    return (*grads, None, None, None, None, d_sinks)


_context_attention.defvjp(_context_attention_fwd, _context_attention_bwd)
