"""Log-likelihoods of many (context, continuation) token requests, packed: `score_requests`.

Each request's input, (context + continuation)[:-1] as lm-eval's causal models feed it, is one segment of a packed
row (RoPE positions restart per segment, attention stays inside it), rows first-fit by length, longest first. One
forward per batch of rows computes hidden states; only the continuation positions go through the head, so a
request costs its tokens, not a padded row's, and never a [tokens, vocab] logits block for its context.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.data.batching import bucket
from jaxtune.models.head import head_logits
from jaxtune.models.kv_cache import prefix_length
from jaxtune.models.llama import decoder


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


def score_requests(params: dict, cfg: ModelConfig, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                   method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
                   batch_tokens: int = 4096, progress=None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether every continuation token is the greedy one) per request.
    With prefix tuning on a model with sliding windows, one request a row.

    requests: (context ids, continuation ids), both non-empty, together at most the model's context + 1 tokens
    (lm-eval truncates on the left before this). batch_tokens: tokens a forward (rows x row length) at least; the row
    length is the power-of-two bucket of the longest request. Every batch is dispatched before the first is read;
    progress(n) is told as n requests finish.
    """
    inputs = [(list(ctx) + list(cont))[:-1] for ctx, cont in requests]
    lengths = [len(x) for x in inputs]
    P = prefix_length(params)
    T = bucket(max(lengths), 16)
    # A sliding window measures distance in row slots: a later segment would lose sight of the prefix-tuning keys.
    rows = [[i] for i in np.argsort(lengths)[::-1]] if P and any(cfg.sliding_windows) else pack_rows(lengths, T)
    R = min(bucket(len(rows)), max(1, batch_tokens // T))
    batches = []
    for start in range(0, len(rows), R):
        tokens, positions, segments = (np.zeros((R, T), np.int32) for _ in range(3))
        picks, targets, owner = [], [], []
        for r, members in enumerate(rows[start: start + R]):
            at = 0
            for segment, i in enumerate(members, start=1):
                n, cont = lengths[i], requests[i][1]
                tokens[r, at: at + n] = inputs[i]
                positions[r, at: at + n] = P + np.arange(n)
                segments[r, at: at + n] = segment
                first = r * T + at + n - len(cont)  # the position whose next token is cont[0]
                picks += range(first, first + len(cont))
                targets += cont
                owner += [i] * len(cont)
                at += n
        batches.append((tokens, positions, segments, picks, targets, np.asarray(owner)))
    C = bucket(max(len(b[3]) for b in batches), 16)  # one shape for every batch: one compile
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
