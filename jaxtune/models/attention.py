"""Blockwise attention (`blockwise_attention`): softmax(q k^T / sqrt(hd)) v with an online softmax over key blocks
(FlashAttention's algorithm, Dao et al. 2022, in pure JAX; any scale, optionally soft-capped) and a hand-written
backward that recomputes each block's scores, so memory is O(T x block) per layer, not the [B, K, G, T, S] scores.
The mask is never materialised whole: an `AttentionMask` (`training_mask`, `cache_mask`) holds its parts (valid
keys, query and key slots, packed segments or prefix trees (`branch_segment`), bidirectional spans (an image's
tokens), the window; P prefix keys in slots 0..P-1, seen by every query) and a block's piece is built when the block
is computed. Blocks no query may see are skipped in both passes (`live_blocks`, once per call, outside the layer
scan); a row of one block runs without loops. Scores, softmax, sums: float32 (float64 inputs: float64). Sinks
(gpt-oss): a logit per query head in each softmax's denominator, a key of value 0 (`join_sinks`, `sink_grads`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.models.linear import wide

BLOCK = 256  # query and key positions per block of a long sequence (`block_size`)
NO_SLOT = 2**30  # the slot of a key block's padding: after every query


class AttentionMask(NamedTuple):
    """What one attention call's mask is made of (see the module docstring); a pytree.

    q_slot_T: int32 [T], each query's slot. k_valid_BxS: bool [B, S], keys that may be attended to (not padding,
    written cache slots). q_segment_BxT, k_segment_BxS: int32 packed-segment ids, 1 .. 2**16 - 1 (keys < 0 are seen
    by all; a `branch_segment` query also sees its segment's shared keys). k_slot_S: int32 [S], each key's slot
    (0..S-1 but where a context-parallel device holds other keys). q_span_BxT, k_span_BxS: int32 bidirectional
    spans (an image's tokens, `models.multimodal`): a query of span s >= 0 also sees the later keys of span s
    (within the window's reach back); -1 outside any; None (no spans, nor any cost of them). q_position_BxT,
    k_position_BxS: int32 RoPE positions, by which chunked layers (window < 0) cut their chunks where a cache's slots
    are not positions (left padding, packed prompts: transformers chunks by position); None: by slot.
    """

    q_slot_T: jax.Array
    k_valid_BxS: jax.Array
    q_segment_BxT: jax.Array
    k_segment_BxS: jax.Array
    k_slot_S: jax.Array
    q_span_BxT: jax.Array | None = None
    k_span_BxS: jax.Array | None = None
    q_position_BxT: jax.Array | None = None
    k_position_BxS: jax.Array | None = None


SLIDING_SPANS = 2**30  # span ids from here up: bidirectional on sliding layers only (Gemma 4's images)
BRANCH_SHIFT = 16  # a prefix tree's ids: (segment << BRANCH_SHIFT) | (branch << LEAF_BITS) | leaf
LEAF_BITS = 8
MAX_BRANCHES = 2**LEAF_BITS - 1  # branches of a tree, and leaves of a branch


def branch_segment(segment, branch, leaf=0):
    """The segment id of branch `branch` (1 .. 255) of segment `segment` (1 .. 2**15 - 1), or of that branch's leaf
    `leaf` (1 .. 255): a prefix tree in one packed row. The segment's shared tokens come first (id `segment`), then
    each branch's, then its leaves'; a token sees its own id's tokens (causally) and its ancestors', not its
    siblings', and takes RoPE positions after its ancestors' tokens, so each path computes as its tokens alone would
    (prompts sharing a prefix; requests sharing a few-shot prefix, then a question, then each choice).
    Needs the blockwise kernel and slots that do not feed a sliding window (a branch's slots run past its position)."""
    return (segment << BRANCH_SHIFT) | (branch << LEAF_BITS) | leaf


def training_mask(B: int, T: int, prefix: int, attention_mask_BxT: jax.Array | None,
                  segment_ids_BxT: jax.Array | None, slots_T: jax.Array | None = None,
                  span_ids_BxT: jax.Array | None = None) -> AttentionMask:
    """The mask of a full forward: P prefix keys seen by every query, then T tokens attending causally to the
    tokens that are not padding (attention_mask_BxT 0) and, if packed, of their own segment. slots_T: the tokens'
    slots (default P..P+T-1; a context-parallel layout's order). span_ids_BxT: bidirectional spans (`AttentionMask`;
    the prefix keys in none)."""
    valid_BxT = jnp.ones((B, T), bool) if attention_mask_BxT is None else attention_mask_BxT > 0
    segment_BxT = jnp.zeros((B, T), jnp.int32) if segment_ids_BxT is None else segment_ids_BxT.astype(jnp.int32)
    slots_T = prefix + jnp.arange(T, dtype=jnp.int32) if slots_T is None else slots_T
    return AttentionMask(
        q_slot_T=slots_T,
        k_valid_BxS=jnp.concatenate([jnp.ones((B, prefix), bool), valid_BxT], axis=1),
        q_segment_BxT=segment_BxT,
        k_segment_BxS=jnp.concatenate([jnp.full((B, prefix), -1, jnp.int32), segment_BxT], axis=1),
        k_slot_S=jnp.concatenate([jnp.arange(prefix, dtype=jnp.int32), slots_T]),
        q_span_BxT=None if span_ids_BxT is None else span_ids_BxT.astype(jnp.int32),
        k_span_BxS=None if span_ids_BxT is None else jnp.concatenate(
            [jnp.full((B, prefix), -1, jnp.int32), span_ids_BxT.astype(jnp.int32)], axis=1),
    )


def cache_mask(start: jax.Array, T: int, valid_BxS: jax.Array) -> AttentionMask:
    """The mask of T new tokens at cache slots start..start+T-1 over a cache whose written slots are valid_BxS."""
    B, S = valid_BxS.shape
    return AttentionMask(q_slot_T=start + jnp.arange(T, dtype=jnp.int32), k_valid_BxS=valid_BxS,
                         q_segment_BxT=jnp.zeros((B, T), jnp.int32), k_segment_BxS=jnp.zeros_like(valid_BxS, jnp.int32),
                         k_slot_S=jnp.arange(S, dtype=jnp.int32))


def _allowed(q_slot_Q, q_segment_BxQ, k_slot_C, k_valid_BxC, k_segment_BxC, window, q_span_BxQ=None,
             k_span_BxC=None, q_position_BxQ=None, k_position_BxC=None, every_span: bool = False) -> jax.Array:
    """[B, Q, C] boolean: which of Q queries may see which of C keys (causally, or within a bidirectional span:
    transformers' `blockwise_overlay` or'ed with causality, then and'ed with the window). Spans numbered from
    SLIDING_SPANS are bidirectional on sliding layers only (window != 0), unless `every_span` (a liveness bound).
    Chunks (window < 0) by q_position_BxQ and k_position_BxC where given, else by slot."""
    relative_QxC = q_slot_Q[:, None] - k_slot_C[None, :]
    chunk = jnp.maximum(-window, 1)  # window < 0: chunks of -window positions (Llama 4)
    if q_position_BxQ is None:
        same_chunk_BxQxC = (q_slot_Q[:, None] // chunk == k_slot_C[None, :] // chunk)[None]
    else:
        same_chunk_BxQxC = q_position_BxQ[:, :, None] // chunk == k_position_BxC[:, None, :] // chunk
    window_BxQxC = ((window == 0) | ((window > 0) & (relative_QxC < window))[None] | ((window < 0) & same_chunk_BxQxC))
    if q_span_BxQ is None:
        position_BxQxC = (relative_QxC >= 0)[None] & window_BxQxC
    else:
        on_layer_BxQ = (q_span_BxQ < SLIDING_SPANS) | (window != 0) | every_span
        span_BxQxC = ((q_span_BxQ[:, :, None] == k_span_BxC[:, None, :]) & (q_span_BxQ[:, :, None] >= 0)
                      & on_layer_BxQ[:, :, None])
        position_BxQxC = ((relative_QxC >= 0)[None] | span_BxQxC) & window_BxQxC
    q_BxQx1, k_Bx1xC = q_segment_BxQ[:, :, None], k_segment_BxC[:, None, :]
    ancestor_BxQxC = ((q_BxQx1 >> BRANCH_SHIFT) == k_Bx1xC) | ((q_BxQx1 & -(2**LEAF_BITS)) == k_Bx1xC)
    shared_BxQxC = (k_Bx1xC > 0) & (q_BxQx1 >= 2**BRANCH_SHIFT) & ancestor_BxQxC  # a branch's or leaf's ancestors
    segment_BxQxC = (k_Bx1xC < 0) | (q_BxQx1 == k_Bx1xC) | shared_BxQxC
    return position_BxQxC & k_valid_BxC[:, None, :] & segment_BxQxC


class _BlockedMask(NamedTuple):
    """The mask's parts cut into blocks, query blocks [nq, ...] and key blocks [nk, ...] leading."""

    q_slot: jax.Array  # [nq, bq]
    q_segment: jax.Array  # [nq, B, bq]
    k_slot: jax.Array  # [nk, bk]
    k_valid: jax.Array  # [nk, B, bk]
    k_segment: jax.Array  # [nk, B, bk]
    q_span: jax.Array | None  # [nq, B, bq]
    k_span: jax.Array | None  # [nk, B, bk]
    q_position: jax.Array | None  # [nq, B, bq]
    k_position: jax.Array | None  # [nk, B, bk]


class _Blocked(NamedTuple):
    """Queries [nq, B, K, G, bq, hd], keys and values [nk, B, K, bk, hd], and the mask, cut into blocks."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    mask: _BlockedMask


def block_size(n: int) -> int:
    """Positions per block along a dimension of n: n itself up to BLOCK (a row of one block runs with no loop,
    `_scan_blocks`), then BLOCK. On XLA:CPU one block of 256 is faster than four of 128 that skip the dead one, and
    on longer rows blocks of 256 are faster than 128 or 512 (benchmarks/README.md, issue 34)."""
    return min(n, BLOCK)


def forward_block_bytes(n: int, heads: int, width: int) -> int:
    """Float32 bytes a forward of `blockwise_attention` (no gradient) holds for one row of n positions attending all
    n, `heads` heads over `width` channels, beyond its inputs and output: one [heads, bq, bk] block of scores; with
    several key blocks, the [n, width] output, max and sum the loop carries (the planner's, for the frozen towers)."""
    bq = block_size(n)
    carried = n * width + 2 * heads * n if bq < n else 0
    return 4 * (heads * bq * bq + carried)


def _cut(x: jax.Array, axis: int, size: int, fill=0) -> jax.Array:
    """x with `axis` padded to a multiple of `size` (with `fill`) and cut into blocks, the block index first."""
    n = x.shape[axis]
    padded = -(-n // size) * size
    if padded != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded - n)
        x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (padded // size, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _blocked_mask(mask: AttentionMask, T: int, S: int) -> _BlockedMask:
    bq, bk = block_size(T), block_size(S)
    return _BlockedMask(
        q_slot=_cut(mask.q_slot_T, 0, bq, fill=-1), q_segment=_cut(mask.q_segment_BxT, 1, bq),
        k_slot=_cut(mask.k_slot_S, 0, bk, fill=NO_SLOT), k_valid=_cut(mask.k_valid_BxS, 1, bk, fill=False),
        k_segment=_cut(mask.k_segment_BxS, 1, bk),
        q_span=None if mask.q_span_BxT is None else _cut(mask.q_span_BxT, 1, bq, fill=-1),
        k_span=None if mask.k_span_BxS is None else _cut(mask.k_span_BxS, 1, bk, fill=-1),
        q_position=None if mask.q_position_BxT is None else _cut(mask.q_position_BxT, 1, bq),
        k_position=None if mask.k_position_BxS is None else _cut(mask.k_position_BxS, 1, bk))


def _blocked(q, k, v, mask: AttentionMask) -> _Blocked:
    T, S = q.shape[3], k.shape[2]
    return _Blocked(_cut(q, 3, block_size(T)), _cut(k, 2, block_size(S)), _cut(v, 2, block_size(S)),
                    _blocked_mask(mask, T, S))


def live_blocks(mask: AttentionMask, T: int, S: int) -> jax.Array:
    """[nq, nk] boolean: blocks in which some query of some row may see some key, the window aside (computed
    once per forward; `window` is applied per layer in `_window_live`)."""
    m = _blocked_mask(mask, T, S)

    def row(q_slot_Q, q_segment_BxQ, q_span_BxQ):
        return jax.vmap(lambda s, kv, ks, kp: jnp.any(_allowed(q_slot_Q, q_segment_BxQ, s, kv, ks, 0, q_span_BxQ, kp,
                                                               every_span=True)))(m.k_slot, m.k_valid, m.k_segment,
                                                                                  m.k_span)

    return jax.lax.map(lambda args: row(*args), (m.q_slot, m.q_segment, m.q_span))


def _window_live(m: _BlockedMask, window: jax.Array) -> jax.Array:
    """[nq, nk] boolean: blocks some query reaches within `window` (True everywhere when window is 0, and for chunks
    by position, which slots do not bound)."""
    if m.q_position is not None:
        window = jnp.where(window < 0, 0, window)
    first_q = jnp.min(jnp.where(m.q_slot >= 0, m.q_slot, NO_SLOT), axis=-1)
    last_k = jnp.max(jnp.where(m.k_slot < NO_SLOT, m.k_slot, -NO_SLOT), axis=-1)
    return (window == 0) | (first_q[:, None] - last_k[None, :] < jnp.abs(window))  # a chunk reaches -window back


def _scan_blocks(body, carry, blocks):
    """lax.scan(body, carry, blocks), or body applied once, with no loop, when there is one block: on XLA:CPU a
    loop's control flow and per-iteration buffers cost more than a dead block they could skip."""
    if jax.tree.leaves(blocks)[0].shape[0] > 1:
        return jax.lax.scan(body, carry, blocks)
    carry, out = body(carry, jax.tree.map(lambda a: a[0], blocks))
    return carry, jax.tree.map(lambda a: a[None], out)


def _if_live(live, update, skip, carry, loop: bool):
    """update(carry) if the block is live else skip(carry): a lax.cond in a loop of blocks, which skips the dead
    blocks' work; a select of the two when the row is one block (no control flow, and nothing to skip)."""
    if loop:
        return jax.lax.cond(live, update, skip, carry)
    return jax.tree.map(partial(jnp.where, live), update(carry), skip(carry))


def _contract_rows(small_BxKxGxQxh, big_BxKxGxQxC):
    """einsum("bkgqc,bkgqh->bkch", big, small) as the transpose of small^T big: only the small operand and result
    are transposed. Contracted the other way, XLA:CPU copies the whole [Q, C] block transposed first; the barrier
    keeps XLA from folding the final transpose back into the dot (which would make it that copy again)."""
    product_BxKxhxC = jnp.einsum("bkgqh,bkgqc->bkhc", small_BxKxGxQxh, big_BxKxGxQxC)
    return jnp.swapaxes(jax.lax.optimization_barrier(product_BxKxhxC), 2, 3)


# Masked scores take the float's minimum, as the dense form does: a query with no allowed key averages the keys it was
# computed against (nothing in a model reads such a query's output).
def _scores(q_blk, k_blk, allowed_BxQxC, scale: float, softcap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """(masked float32 (float64) scores [B, K, G, Q, C], tanh(scaled / softcap) unmasked or None without a cap).

    With a cap the scores are softcap * tanh(q k^T scale / softcap) (Gemma 2's attention-logit soft-capping)."""
    dtype = wide(q_blk.dtype)
    s = jnp.einsum("bkgqh,bkch->bkgqc", q_blk, k_blk, preferred_element_type=dtype) * scale
    tanh = None
    if softcap:
        tanh = jnp.tanh(s / softcap)
        s = softcap * tanh
    return jnp.where(allowed_BxQxC[:, None, None], s, jnp.finfo(dtype).min), tanh


def attend_blocks(q, k, v, mask: AttentionMask, window, live_QxC, scale: float, softcap: float | None,
                  sinks_KxG: jax.Array | None = None):
    """(out [B, K, G, T, hd] and log-sum-exp [B, K, G, T], both float32 (float64 for float64 q)) of q [B, K, G, T,
    hd] over keys and values [B, K, S, hd] (and the sinks [K, G], in the log-sum-exp too) as `blockwise_attention`
    computes them, without its backward."""
    B, K, G, T, hd = q.shape
    blocks = _blocked(q, k, v, mask)
    m = blocks.mask
    live_QxC = live_QxC & _window_live(m, window)
    bq = blocks.q.shape[-2]
    f32 = wide(q.dtype)
    loop = blocks.q.shape[0] * blocks.k.shape[0] > 1

    def query_block(_, args):
        q_blk, q_slot, q_segment, q_span, q_position, live_C = args

        def key_block(carry, key_args):
            k_blk, v_blk, k_slot, k_valid, k_segment, k_span, k_position, live = key_args

            def update(carry):
                max_, norm, acc = carry
                allowed = _allowed(q_slot, q_segment, k_slot, k_valid, k_segment, window, q_span, k_span,
                                   q_position, k_position)
                s, _ = _scores(q_blk, k_blk, allowed, scale, softcap)
                new_max = jnp.maximum(max_, jnp.max(s, axis=-1))
                p = jnp.exp(s - new_max[..., None])
                correction = jnp.exp(max_ - new_max)
                norm = norm * correction + jnp.sum(p, axis=-1)
                acc = acc * correction[..., None] + jnp.einsum("bkgqc,bkch->bkgqh", p, v_blk.astype(f32))
                return new_max, norm, acc

            return _if_live(live, update, lambda c: c, carry, loop), None

        if sinks_KxG is None:
            max_norm = (jnp.full((B, K, G, bq), jnp.finfo(f32).min, f32), jnp.zeros((B, K, G, bq), f32))
        else:  # the sink is the first key every query sees: max = sink, norm = exp(sink - max) = 1, its value 0;
            # so a query that sees no key gets output 0 (each masked score's exp(min - sink) is 0), finite
            sink_BxKxGxQ = jnp.broadcast_to(sinks_KxG.astype(f32)[:, :, None], (B, K, G, bq))
            max_norm = (sink_BxKxGxQ, jnp.ones((B, K, G, bq), f32))
        init = (*max_norm, jnp.zeros((B, K, G, bq, hd), f32))
        (max_, norm, acc), _ = _scan_blocks(key_block, init, (blocks.k, blocks.v, m.k_slot, m.k_valid,
                                                              m.k_segment, m.k_span, m.k_position, live_C))
        norm = jnp.where(norm == 0, 1.0, norm)  # a query no live block reached (and no sink): output 0
        return None, (acc / norm[..., None], max_ + jnp.log(norm))

    _, (out, lse) = _scan_blocks(query_block, None, (blocks.q, m.q_slot, m.q_segment, m.q_span, m.q_position,
                                                     live_QxC))
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, -1, hd)[:, :, :, :T]
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, -1)[:, :, :, :T]
    return out, lse


def join_sinks(out, lse, sinks_KxG: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of attention over some keys [B, K, G, T, hd], [B, K, G, T] float32 (float64) with the sinks [K, G]
    joined to each query's denominator: once, after merging every key block's (out, lse)."""
    lse_with = jnp.logaddexp(lse, sinks_KxG.astype(lse.dtype)[:, :, None])
    return out * jnp.exp(lse - lse_with)[..., None], lse_with


def sink_grads(sinks_KxG: jax.Array, out, lse, g) -> jax.Array:
    """d/d sinks [K, G] float32 (float64) for the cotangent g [B, K, G, T, hd] of the attention's output `out`, its
    log-sum-exp `lse` [B, K, G, T] including the sinks: -sum over rows and queries of p_sink * rowsum(g out), p_sink =
    exp(sink - lse) (the sink's value is 0: it moves the output only through the denominator)."""
    f32 = lse.dtype
    delta_BxKxGxT = jnp.sum(g.astype(f32) * out.astype(f32), axis=-1)
    p_sink_BxKxGxT = jnp.exp(sinks_KxG.astype(f32)[:, :, None] - lse)
    return -jnp.sum(p_sink_BxKxGxT * delta_BxKxGxT, axis=(0, 3))


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(q, k, v, mask, window, live_QxC, sinks_KxG, scale, softcap):
    return attend_blocks(q, k, v, mask, window, live_QxC, scale, softcap, sinks_KxG)[0].astype(q.dtype)


def _attention_fwd(q, k, v, mask, window, live_QxC, sinks_KxG, scale, softcap):
    out, lse = attend_blocks(q, k, v, mask, window, live_QxC, scale, softcap, sinks_KxG)
    out = out.astype(q.dtype)
    return out, (q, k, v, mask, window, live_QxC, sinks_KxG, out, lse)


def _attention_bwd(scale, softcap, residuals, g):
    q, k, v, mask, window, live_QxC, sinks_KxG, out, lse = residuals
    dq, dk, dv = attention_grads(q, k, v, mask, window, live_QxC, out, lse, g, scale, softcap, whole_row=True)
    dsinks = None if sinks_KxG is None else sink_grads(sinks_KxG, out, lse, g).astype(sinks_KxG.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, dsinks


def attention_grads(q, k, v, mask: AttentionMask, window, live_QxC, out, lse, g, scale: float,
                    softcap: float | None, whole_row: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in float32 (float64) of `attend_blocks`' output for the cotangent g [B, K, G, T, hd], given the
    output `out` and log-sum-exp `lse` of the whole attention (over these keys, any others and any sinks: a sink
    reaches dq, dk, dv only through lse; its own gradient is `sink_grads`).

    FlashAttention-2's backward: per block, p = exp(s - lse), dv += p^T g, ds = p (g v^T - rowsum(g o)),
    dq += ds k, dk += ds^T q (both scaled; with a soft cap, ds also times 1 - tanh^2); an outer loop over key
    blocks, an inner one over query blocks. whole_row: these keys are all the row's (no other device's), so a row of
    one block takes rowsum(g o) as rowsum(p dp) (equal: a sink's value is 0), which XLA:CPU fuses into dp's product
    at its own rate (rowsum(g o) fused there made that product 2.5x slower; benchmarks/README.md, issue 54)."""
    B, K, G, T, hd = q.shape
    S = k.shape[2]
    f32 = wide(q.dtype)
    blocks = _blocked(q, k, v, mask)
    m = blocks.mask
    live_QxC = live_QxC & _window_live(m, window)
    bq = blocks.q.shape[-2]
    g_blocks = _cut(g, 3, bq)
    lse_blocks = _cut(lse, 3, bq)
    loop = blocks.q.shape[0] * blocks.k.shape[0] > 1
    delta = None if whole_row and not loop else _cut(jnp.sum(g.astype(f32) * out.astype(f32), axis=-1), 3, bq)

    def key_block(dq, key_args):
        k_blk, v_blk, k_slot, k_valid, k_segment, k_span, k_position, live_Q = key_args

        def query_block(carry, query_args):
            q_blk, g_blk, lse_blk, delta_blk, q_slot, q_segment, q_span, q_position, live = query_args

            def update(carry):
                dk, dv = carry
                allowed = _allowed(q_slot, q_segment, k_slot, k_valid, k_segment, window, q_span, k_span,
                                   q_position, k_position)
                s, tanh = _scores(q_blk, k_blk, allowed, scale, softcap)
                p = jnp.exp(s - lse_blk[..., None])
                dv = dv + _contract_rows(g_blk.astype(f32), p)
                dp = jnp.einsum("bkgqh,bkch->bkgqc", g_blk, v_blk, preferred_element_type=f32)
                row_delta = jnp.sum(p * dp, axis=-1) if delta_blk is None else delta_blk  # [B, K, G, bq]
                ds = p * (dp - row_delta[..., None]) * scale
                if softcap:
                    ds = ds * (1 - tanh * tanh)
                dk = dk + _contract_rows(q_blk.astype(f32), ds)
                return (dk, dv), jnp.einsum("bkgqc,bkch->bkgqh", ds, k_blk.astype(f32))

            skip = lambda carry: (carry, jnp.zeros(q_blk.shape, f32))
            return _if_live(live, update, skip, carry, loop)

        zeros = jnp.zeros(k_blk.shape, f32)
        (dk, dv), dq_blocks = _scan_blocks(query_block, (zeros, zeros), (
            blocks.q, g_blocks, lse_blocks, delta, m.q_slot, m.q_segment, m.q_span, m.q_position, live_Q))
        return dq + dq_blocks, (dk, dv)

    dq = jnp.zeros(blocks.q.shape, f32)
    dq, (dk, dv) = _scan_blocks(key_block, dq, (blocks.k, blocks.v, m.k_slot, m.k_valid,
                                                 m.k_segment, m.k_span, m.k_position, live_QxC.T))
    dq = jnp.moveaxis(dq, 0, 3).reshape(B, K, G, -1, hd)[:, :, :, :T]
    dk, dv = (jnp.moveaxis(d, 0, 2).reshape(B, K, -1, hd)[:, :, :S] for d in (dk, dv))
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q_BxKxGxTxh: jax.Array, k_BxKxSxh: jax.Array, v_BxKxSxh: jax.Array, mask: AttentionMask,
                        window: jax.Array | int = 0, live_QxC: jax.Array | None = None, *, scale: float | None = None,
                        softcap: float | None = None, sinks_KxG: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T scale) v [B, K, G, T, hd] over the keys `mask` allows (G query heads share each of the K
    key/value heads), in q's dtype.

    window: the layer's sliding window (0: none), as the slots count it. live_QxC: `live_blocks(mask, T, S)` when
    the caller computes it once for many layers; None computes it here. scale: default 1 / sqrt(hd). softcap: the
    scores become softcap * tanh(scores / softcap) before the mask and the softmax (None: uncapped). sinks_KxG: each
    query head's attention sink [K, G], a logit in every query's softmax (not capped) whose probability is dropped
    (gpt-oss; a query that sees no key then gets 0), differentiable; None: no sinks (nor any cost of them).
    """
    T, S = q_BxKxGxTxh.shape[3], k_BxKxSxh.shape[2]
    if live_QxC is None:
        live_QxC = live_blocks(mask, T, S)
    scale = q_BxKxGxTxh.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attention(q_BxKxGxTxh, k_BxKxSxh, v_BxKxSxh, mask, jnp.asarray(window, jnp.int32), live_QxC, sinks_KxG,
                      scale, float(softcap) if softcap else None)


