"""Log-likelihoods of many (context, continuation) token requests, packed: `score_requests`.

Each request's input, (context + continuation)[:-1] as lm-eval's causal models feed it, is computed in packed rows
(RoPE positions restart per segment, attention stays inside it), rows first-fit by length, longest first. Shared
tokens are computed once, as a prefix tree (`attention.branch_segment`): its root the first tokens several contexts
share (a few-shot prefix, a task's question template), a branch per context, a leaf per continuation (a question's
choices). One forward per batch of rows; only the continuation positions go through the head, so a request costs
its own tokens, never a [tokens, vocab] block for its context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.data.batching import bucket
from jaxtune.generation import prefix_trees
from jaxtune.models.attention import BRANCH_SHIFT, MAX_BRANCHES, branch_segment
from jaxtune.models.head import head_logits
from jaxtune.models.kv_cache import prefix_length
from jaxtune.models.llama import decoder
from jaxtune.parallel.rules import context_ways


@partial(jax.jit, static_argnames=("cfg", "method", "options"))
def continuation_logprobs(params: dict, tokens_RxT, positions_RxT, segments_RxT, picks_C, targets_C, *,
                          cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions):
    """(log p of each picked target [C] float32, whether it is the argmax [C] bool).

    tokens/positions/segments [R, T]: packed rows (segment 0 is padding). picks_C: flat indices into R*T of the
    positions whose next token is scored; targets_C: those tokens.
    """
    R, T = tokens_RxT.shape
    hidden_RxTxD = decoder(params, tokens_RxT, cfg, positions_BxT=positions_RxT, segment_ids_BxT=segments_RxT,
                           method=method, options=options)
    hidden_1xCxD = hidden_RxTxD.reshape(R * T, -1)[picks_C][None]
    logits_CxV = head_logits(params, hidden_1xCxD, cfg.final_logit_softcap, pieces=False)[0]
    logits_CxV = logits_CxV[:, : cfg.vocab_size]
    log_z_C = jax.nn.logsumexp(logits_CxV, axis=-1)
    picked_C = jnp.take_along_axis(logits_CxV, targets_C[:, None], axis=-1)[:, 0]
    return picked_C - log_z_C, jnp.argmax(logits_CxV, axis=-1) == targets_C


def pack_rows(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Request indices per row, first-fit decreasing by length: every row holds at most `row_length` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row_length - lengths[i])
    return rows


def _contexts(requests, shared: bool) -> list[tuple[list[int], list[int]]]:
    """(context ids, request indices) per context: requests with equal contexts together if `shared`, cut so that
    each holds at most MAX_BRANCHES requests."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        groups.setdefault(tuple(ctx) if shared else (i,), []).append(i)
    return [(list(requests[members[0]][0]), members[at: at + MAX_BRANCHES])
            for members in groups.values() for at in range(0, len(members), MAX_BRANCHES)]


def _split(contexts, requests, cap: int) -> list[tuple[list[int], list[int]]]:
    """The contexts cut so that each holds at most `cap` tokens (itself once, each request's continuation[:-1])."""
    pieces = []
    for ctx, members in contexts:
        piece: list[int] = []
        size = len(ctx)
        for i in members:
            n = len(requests[i][1]) - 1
            if piece and size + n > cap:
                pieces.append((ctx, piece))
                piece, size = [], len(ctx)
            piece.append(i)
            size += n
        pieces.append((ctx, piece))
    return pieces


def score_requests(params: dict, cfg: ModelConfig, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                   method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
                   batch_tokens: int = 4096, progress=None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether every continuation token is the greedy one) per request.

    requests: (context ids, continuation ids), both non-empty, together at most the model's context + 1 tokens
    (lm-eval truncates on the left before this). Shared computation, with the blockwise attention kernel: a prefix
    tree per row piece, its root the first tokens several contexts share (a few-shot prefix), a branch per context,
    a leaf per continuation; except under a sliding window narrower than a row or with a context mesh axis. With
    prefix tuning on a model with sliding windows, one request a row. batch_tokens: tokens a forward (rows x row
    length) at least; the row length is the power-of-two bucket of the largest tree, at most 2 x bucket(2 x the
    longest request). Every batch is dispatched before the first is read; progress(n) is told as n requests finish.
    """
    lengths = [len(ctx) + len(cont) - 1 for ctx, cont in requests]
    P = prefix_length(params)
    alone = bool(P and any(cfg.sliding_windows))  # a window counts slots: later segments would lose the prefix keys
    row = bucket(2 * max(lengths), 16)
    narrowest = min([w for w in cfg.sliding_windows if w], default=2 * row)  # no slot of a row may leave a window
    shared = not alone and context_ways() == 1 and 2 * row < 2 ** BRANCH_SHIFT // 2 and narrowest >= row
    cap = min(2 * row, narrowest) if shared else row  # room for a tree of several questions
    contexts = _split(_contexts(requests, shared), requests, cap)
    extra = [sum(len(requests[i][1]) - 1 for i in members) for _, members in contexts]
    trees = (prefix_trees([ctx for ctx, _ in contexts], range(len(contexts)), cap, extra, min_shared=1) if shared
             else [(0, [t]) for t in range(len(contexts))])
    sizes = [c + sum(len(contexts[t][0]) - c + extra[t] for t in branches) for c, branches in trees]
    T = min(bucket(max(sizes), 16), cap)
    if shared:
        options = dataclasses.replace(options, attention="blockwise")  # fused kernels know plain segments only
    rows = [[i] for i in np.argsort(sizes)[::-1]] if alone else pack_rows(sizes, T)
    most = max(1, batch_tokens // T)
    R = -(-len(rows) // -(-len(rows) // most))  # the rows spread evenly over the fewest batches
    batches = []
    for start in range(0, len(rows), R):
        tokens: np.ndarray = np.zeros((R, T), np.int32)
        positions: np.ndarray = np.zeros((R, T), np.int32)
        segments: np.ndarray = np.zeros((R, T), np.int32)
        picks, targets, owner = [], [], []

        def put(r, at, ids, first, segment):  # ids at row r from slot `at`, RoPE positions from `first`
            n = len(ids)
            tokens[r, at: at + n], positions[r, at: at + n], segments[r, at: at + n] = ids, P + first + np.arange(n), \
                segment
            return at + n

        for r, members in enumerate(rows[start: start + R]):
            at = 0
            for segment, t in enumerate(members, start=1):
                c, branches = trees[t]
                at = put(r, at, contexts[branches[0]][0][:c], 0, segment)
                for branch, b in enumerate(branches, start=1):
                    ctx, leaves = contexts[b]
                    at = put(r, at, ctx[c:], c, branch_segment(segment, branch) if shared else segment)
                    last = r * T + at - 1  # the context's last token: it predicts each cont[0]
                    for leaf, i in enumerate(leaves, start=1):
                        cont = list(requests[i][1])
                        picks += [last, *range(r * T + at, r * T + at + len(cont) - 1)]
                        at = put(r, at, cont[:-1], len(ctx), branch_segment(segment, branch, leaf) if shared
                                 else segment)
                        targets += cont
                        owner += [i] * len(cont)
        batches.append((tokens, positions, segments, picks, targets, np.asarray(owner)))
    C = -(-max(len(b[3]) for b in batches) // 128) * 128  # one shape for every batch: one compile
    pending = []
    for tokens, positions, segments, picks, targets, owner in batches:
        picks_C: np.ndarray = np.zeros(C, np.int32)
        targets_C: np.ndarray = np.zeros(C, np.int32)
        picks_C[: len(picks)], targets_C[: len(targets)] = picks, targets
        pending.append((owner, continuation_logprobs(params, tokens, positions, segments, picks_C, targets_C,
                                                     cfg=cfg, method=method, options=options)))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for owner, scored in pending:
        logp_C, greedy_C = (a[: len(owner)] for a in jax.device_get(scored))
        for i in np.unique(owner):
            mine = owner == i
            results[i] = (float(np.sum(logp_C[mine], dtype=np.float32)), bool(np.all(greedy_C[mine])))
        if progress is not None:
            progress(len(np.unique(owner)))
    scored = [r for r in results if r is not None]
    assert len(scored) == len(results)  # every continuation is non-empty, so every request is scored
    return scored
