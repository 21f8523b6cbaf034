"""Log-likelihoods of many (context, continuation) token requests, packed: `score_requests`.

Each request's input, (context + continuation)[:-1] as lm-eval's causal models feed it, is computed in packed rows
(RoPE positions restart per segment, attention stays inside it), rows first-fit by length, longest first. Requests
that share a context (a question's choices) share one computation of it: the context, then each continuation as a
branch of a prefix tree (`attention.branch_segment`). One forward per batch of rows; only the continuation
positions go through the head, so a request costs its own tokens, never a [tokens, vocab] block for its context.
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
from jaxtune.models.attention import BRANCH_SHIFT, branch_segment
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
    rows, room = [], []
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


def _trees(requests, shared: bool) -> list[tuple[list[int], list[int]]]:
    """(context ids, request indices) per computation: requests with equal contexts together if `shared`."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        groups.setdefault(tuple(ctx) if shared else (i,), []).append(i)
    return [(list(requests[members[0]][0]), members) for members in groups.values()]


def _split(trees, requests, cap: int) -> list[tuple[list[int], list[int]]]:
    """The trees cut so that each holds at most `cap` tokens (its context once, each branch's continuation[:-1])."""
    pieces = []
    for ctx, members in trees:
        piece, size = [], len(ctx)
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
    (lm-eval truncates on the left before this). Equal contexts are computed once (a prefix tree; with the
    blockwise attention kernel), except under a sliding window narrower than a row or with a context mesh axis;
    with prefix tuning on a model with sliding windows, one request a row. batch_tokens: tokens a forward (rows x
    row length) at least; the row length is the power-of-two bucket of the largest tree, at most twice the longest
    request's. Every batch is dispatched before the first is read; progress(n) is told as n requests finish.
    """
    lengths = [len(ctx) + len(cont) - 1 for ctx, cont in requests]
    P = prefix_length(params)
    alone = bool(P and any(cfg.sliding_windows))  # a window counts slots: later segments would lose the prefix keys
    cap = bucket(2 * max(lengths), 16)
    shared = (not alone and context_ways() == 1 and cap < 2 ** BRANCH_SHIFT // 2
              and all(w == 0 or w >= cap for w in cfg.sliding_windows))
    size = lambda tree: len(tree[0]) + sum(len(requests[i][1]) - 1 for i in tree[1])  # noqa: E731
    trees = _trees(requests, shared)
    T = min(bucket(max(map(size, trees)), 16), cap)
    trees = _split(trees, requests, T)
    sizes = [size(tree) for tree in trees]
    if any(len(members) > 1 for _, members in trees):
        options = dataclasses.replace(options, attention="blockwise")  # fused kernels know plain segments only
    rows = [[i] for i in np.argsort(sizes)[::-1]] if alone else pack_rows(sizes, T)
    most = max(1, batch_tokens // T)
    R = -(-len(rows) // -(-len(rows) // most))  # the rows spread evenly over the fewest batches
    batches = []
    for start in range(0, len(rows), R):
        tokens, positions, segments = (np.zeros((R, T), np.int32) for _ in range(3))
        picks, targets, owner = [], [], []
        for r, members in enumerate(rows[start: start + R]):
            at = 0
            for segment, t in enumerate(members, start=1):
                ctx, branches = trees[t]
                n = len(ctx)
                tokens[r, at: at + n], positions[r, at: at + n], segments[r, at: at + n] = ctx, P + np.arange(n), \
                    segment
                last, at = r * T + at + n - 1, at + n  # the context's last token: it predicts each cont[0]
                for branch, i in enumerate(branches, start=1):
                    cont = list(requests[i][1])
                    m = len(cont) - 1
                    tokens[r, at: at + m], positions[r, at: at + m] = cont[:-1], P + n + np.arange(m)
                    segments[r, at: at + m] = branch_segment(segment, branch) if len(branches) > 1 else segment
                    picks += [last, *range(r * T + at, r * T + at + m)]
                    targets += cont
                    owner += [i] * len(cont)
                    at += m
        batches.append((tokens, positions, segments, picks, targets, np.asarray(owner)))
    C = -(-max(len(b[3]) for b in batches) // 128) * 128  # one shape for every batch: one compile
    pending = []
    for tokens, positions, segments, picks, targets, owner in batches:
        picks_C, targets_C = np.zeros(C, np.int32), np.zeros(C, np.int32)
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
    return results
