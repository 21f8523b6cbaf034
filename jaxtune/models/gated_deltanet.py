"""The gated delta rule (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"), the linear attention of
Qwen3-Next's and Qwen3.5's linear layers: per value head a state S [dk, dv] that each token decays by exp(g_t),
corrects toward its value and reads with its query:

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t / sqrt(dk)

`chunk_gated_delta_rule` trains it in chunks (in one, the UT transform's inverse by block doubling and matmuls;
across chunks a `lax.scan` carries S; packed rows' segments restart at `reset_BxT`, masked so no -inf enters a sum);
`recurrent_gated_delta_rule` steps token by token from a state (decoding). Both follow transformers' torch functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.models.linear import wide


def _heads_first(q_BxTxHxK, k_BxTxHxK, v_BxTxNxV, g_BxTxN, beta_BxTxN, l2_normalize: bool):
    """[B, N, T, ...] float32 (float64) inputs: q and k repeated from their H heads to the N value heads (each serving
    N / H consecutive ones), L2-normalised if asked, q scaled by dk^-1/2."""
    dtype = wide(q_BxTxHxK.dtype)
    N, H = v_BxTxNxV.shape[2], q_BxTxHxK.shape[2]
    q, k = (jnp.repeat(a, N // H, axis=2) for a in (q_BxTxHxK, k_BxTxHxK))
    q, k, v, g, beta = (jnp.swapaxes(a.astype(dtype), 1, 2) for a in (q, k, v_BxTxNxV, g_BxTxN, beta_BxTxN))
    if l2_normalize:  # as the FLA library: x / sqrt(sum x^2 + 1e-6)
        q, k = (a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6) for a in (q, k))
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def unit_lower_inverse(a_xCxC: jax.Array) -> jax.Array:
    """(I + strictly_lower(a))^-1 [..., C, C] by doubling: the inverses of the diagonal blocks of size s give those
    of size 2s, [[A^-1, 0], [-B^-1 L A^-1, B^-1]] with L the block below A; matmuls only, log2 C rounds. (jaxlib's
    batched triangular solve on CPU waits for its batch on XLA's intra-op pool from a thread of that pool: two at
    once on a 2-thread pool hung the Qwen3.5 backward for good.)"""
    *batch, C, _ = a_xCxC.shape
    P = 1 << (C - 1).bit_length()  # padded to a power of two with identity rows
    lower = jnp.pad(jnp.tril(a_xCxC, -1), [(0, 0)] * len(batch) + [(0, P - C), (0, P - C)])
    inv = jnp.ones((*batch, P, 1, 1), a_xCxC.dtype)  # the inverses of the 1 x 1 diagonal blocks
    s = 1
    while s < P:
        m = P // (2 * s)
        pairs = jnp.moveaxis(jnp.diagonal(lower.reshape(*batch, m, 2 * s, m, 2 * s), axis1=-4, axis2=-2), -1, -3)
        A, B = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        below = -B @ pairs[..., s:, :s] @ A
        zeros = jnp.zeros_like(below)
        inv = jnp.concatenate([jnp.concatenate([A, zeros], -1), jnp.concatenate([below, B], -1)], -2)
        s *= 2
    return inv[..., 0, :C, :C]


def chunk_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxNxV, g_BxTxN, beta_BxTxN, *, chunk: int = 64,
                           state_BxNxKxV=None, l2_normalize: bool = True, reset_BxT=None):
    """(outputs [B, T, N, dv] in v's dtype, final state [B, N, dk, dv] float32) of the gated delta rule over T
    tokens (padded to a multiple of `chunk` with tokens that change nothing: g = beta = 0), from `state_BxNxKxV`
    (default zeros). g: log decays (<= 0); beta: update strengths in (0, 1); reset_BxT: tokens whose state starts
    from zero (None: none)."""
    B, T, N, dv = v_BxTxNxV.shape
    q, k, v, g, beta = _heads_first(q_BxTxHxK, k_BxTxHxK, v_BxTxNxV, g_BxTxN, beta_BxTxN, l2_normalize)
    dk = q.shape[-1]
    pad = -T % chunk
    q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
    g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    C, n = chunk, (T + pad) // chunk
    as_chunks = lambda a: a.reshape(B, N, n, C, *a.shape[3:])  # noqa: E731
    q, k, v, g, beta = map(as_chunks, (q, k, v, g, beta))  # [B, N, n, C, ...]
    cum_BxNxnxC = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
    causal_CxC = jnp.tril(jnp.ones((C, C), bool))
    # the resets so far within each token's chunk: tokens i, j see each other only with equal counts; a token sees
    # the state carried into its chunk only before the chunk's first reset, and reaches the chunk's end only after
    # its last
    resets = (jnp.zeros((B, T + pad), jnp.int32) if reset_BxT is None
              else jnp.pad(reset_BxT.astype(jnp.int32), ((0, 0), (0, pad))))
    seen_Bx1xnxC = jnp.cumsum(resets.reshape(B, 1, n, C), axis=-1)
    linked_CxC = causal_CxC & (seen_Bx1xnxC[..., :, None] == seen_Bx1xnxC[..., None, :])
    from_start, reaches_end = seen_Bx1xnxC == 0, seen_Bx1xnxC == seen_Bx1xnxC[..., -1:]
    decay_CxC = jnp.exp(jnp.where(linked_CxC, cum_BxNxnxC[..., :, None] - cum_BxNxnxC[..., None, :], -jnp.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # The UT transform: the chunk's sequential corrections as (I + strictly_lower(K_beta K^T * decay))^-1
    corrections_CxC = unit_lower_inverse(jnp.einsum("bnicd,bnied->bnice", k_beta, k) * decay_CxC)
    start_decay = jnp.where(from_start, jnp.exp(cum_BxNxnxC), 0)
    values_new, keys_decayed = corrections_CxC @ v_beta, corrections_CxC @ (k_beta * start_decay[..., None])
    attn_CxC = jnp.einsum("bnicd,bnied->bnice", q, k) * decay_CxC
    q_decayed = q * start_decay[..., None]
    k_to_end = k * jnp.where(reaches_end, jnp.exp(cum_BxNxnxC[..., -1:] - cum_BxNxnxC), 0)[..., None]
    chunk_decay = start_decay[..., -1][..., None, None]  # [B, N, n, 1, 1]

    def step(S_BxNxKxV, xs):
        values, keys, queries, attn, to_end, decay = xs
        v_new = values - keys @ S_BxNxKxV
        out = queries @ S_BxNxKxV + attn @ v_new
        return S_BxNxKxV * decay + jnp.swapaxes(to_end, -1, -2) @ v_new, out

    S0 = (jnp.zeros((B, N, dk, dv), q.dtype) if state_BxNxKxV is None else state_BxNxKxV.astype(q.dtype))
    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (values_new, keys_decayed, q_decayed, attn_CxC, k_to_end, chunk_decay))
    S, out_nxBxNxCxV = jax.lax.scan(step, S0, xs)
    out = jnp.moveaxis(out_nxBxNxCxV, 0, 2).reshape(B, N, n * C, dv)[:, :, :T]
    return jnp.swapaxes(out, 1, 2).astype(v_BxTxNxV.dtype), S


def recurrent_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxNxV, g_BxTxN, beta_BxTxN, *, state_BxNxKxV=None,
                               l2_normalize: bool = True):
    """`chunk_gated_delta_rule`'s result token by token (a scan over T): decoding, one token a step, from the
    state a prefill left."""
    B, T, N, dv = v_BxTxNxV.shape
    q, k, v, g, beta = _heads_first(q_BxTxHxK, k_BxTxHxK, v_BxTxNxV, g_BxTxN, beta_BxTxN, l2_normalize)

    def step(S_BxNxKxV, xs):
        q_t, k_t, v_t, g_t, beta_t = xs  # [B, N, dk], [B, N, dk], [B, N, dv], [B, N], [B, N]
        S_BxNxKxV = S_BxNxKxV * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bnk,bnkv->bnv", k_t, S_BxNxKxV)) * beta_t[..., None]
        S_BxNxKxV = S_BxNxKxV + k_t[..., :, None] * delta[..., None, :]
        return S_BxNxKxV, jnp.einsum("bnk,bnkv->bnv", q_t, S_BxNxKxV)

    S0 = jnp.zeros((B, N, q.shape[-1], dv), q.dtype) if state_BxNxKxV is None else state_BxNxKxV.astype(q.dtype)
    S, out_TxBxNxV = jax.lax.scan(step, S0, tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(out_TxBxNxV, 0, 1).astype(v_BxTxNxV.dtype), S
