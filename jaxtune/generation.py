"""Text generation: batched prompts, a key/value cache, greedy or sampled decoding, EOS, stop tokens and strings.

    texts = generate_text(params, cfg, tokenizer, ["Q: 2+2?"], stop_strings=["\n"])  # ["\n"] or one list per row
Two programs, each compiled once per bucket: `begin` prefills the prompts packed several to a row (`pack_prompts`;
compute ~ their tokens, not rows x the longest; a prefix shared by several prompts once, `prefix_trees`) into a
cache of left-padded rows, and `decode_more` runs a `lax.while_loop` of decode steps on it (donated) until every
row has finished or step `until`. Without stop strings one call decodes to the end; with them, chunks of
`chunk_steps` steps, the host checking each row's text in between.
Temperature, top-k, top-p, the seed and each row's limit are traced; sampling is transformers' order (`filter_logits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import MIN_BUCKET, bucket, pack_plan
from jaxtune.data.formats import render_chat
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.adapter_rows import adapter_slots
from jaxtune.models.attention import MAX_BRANCHES, branch_segment
from jaxtune.models.kv_cache import (
    KVCache,
    PackedPrompts,
    decode_step,
    prefill_packed,
    prefix_length,
    refuse_context_axis,
    split_cache_rows,
)
from jaxtune.parallel.distributed import host_copy
from jaxtune.parallel.rules import constrain
from jaxtune.stop_strings import StopStrings


def filter_logits(logits_BxV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits with -inf outside the top-k tokens, then outside the top-p nucleus of what is left.

    top_k 0 keeps every token. Thresholds are values, so tokens tied with the last kept one are kept too.
    """
    V = logits_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)  # descending
    rank_V = jnp.arange(V)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    in_top_k_BxV = rank_V < k
    probs_BxV = jax.nn.softmax(jnp.where(in_top_k_BxV, sorted_BxV, -jnp.inf), axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # probability of the better-ranked tokens
    keep_BxV = in_top_k_BxV & ((mass_before_BxV < top_p) | (rank_V == 0))
    n_kept_B = jnp.sum(keep_BxV, axis=-1)  # keep is a prefix of the ranking: mass_before only grows
    threshold_Bx1 = jnp.take_along_axis(sorted_BxV, n_kept_B[:, None] - 1, axis=-1)
    return jnp.where(logits_BxV >= threshold_Bx1, logits_BxV, -jnp.inf)


def sample(logits_BxV: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Token ids [B] drawn from the filtered, temperature-scaled distribution."""
    filtered = filter_logits(logits_BxV / temperature, top_k, top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


class DecodeState(NamedTuple):
    """The decode loop's carry, a pytree: step [] int32 (tokens picked so far), the logits [B, V] to pick the next
    from, the cache, out_BxN (each row's tokens, -1 once it has finished) and done_B."""

    step: jax.Array
    logits_BxV: jax.Array
    cache: KVCache
    out_BxN: jax.Array
    done_B: jax.Array


def split_rows(state: DecodeState) -> DecodeState:
    """`state` with its rows split over the batch axes of the mesh in context (`kv_cache.split_cache_rows`), so that a
    policy split over a training mesh decodes each device's own rows (the run's batch function is called under its
    mesh); itself without one."""
    return DecodeState(state.step, constrain(state.logits_BxV, ("batch", None)), split_cache_rows(state.cache),
                       constrain(state.out_BxN, ("batch", None)), constrain(state.done_B, ("batch",)))


@partial(jax.jit, static_argnames=("cfg", "method", "options", "cache_size", "max_new_tokens"))
def begin(params, packed: PackedPrompts, live_B, limit_B, *, cfg: ModelConfig, method: MethodConfig | None,
          options: ForwardOptions, cache_size: int, max_new_tokens: int) -> DecodeState:
    """The state before the first new token: the packed prompts prefilled (`kv_cache.prefill_packed`) into B cache
    rows. live_B: rows that hold a prompt (the rest pad the batch bucket); limit_B: [B] int32, each row's limit."""
    logits_BxV, cache = prefill_packed(params, packed, cfg, cache_size=cache_size, method=method, options=options)
    out_BxN = jnp.full((live_B.shape[0], max_new_tokens), -1, jnp.int32)
    return split_rows(DecodeState(jnp.asarray(0, jnp.int32), logits_BxV, cache, out_BxN, ~live_B | (limit_B < 1)))


@partial(jax.jit, static_argnames=("cfg", "method", "options", "greedy"), donate_argnames=("state",))
def decode_more(params, state: DecodeState, limit_B, is_stop_V, temperature, top_k, top_p, key, until,
                adapter_B=None, *, cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions,
                greedy: bool) -> DecodeState:
    """`state` after decode steps until every row is done or `until` tokens are picked (a traced int32, so chunks of
    any length share the program). A row is done after a token of `is_stop_V` [V] (kept in out_BxN) or its
    `limit_B` tokens. adapter_B: [B] int32, each row's slot of the adapter stacks `params` carries, or None."""

    def pick(logits_BxV, step):
        if greedy:
            return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        return sample(logits_BxV, jax.random.fold_in(key, step), temperature, top_k, top_p)

    def unfinished(s: DecodeState):
        return (s.step < until) & ~jnp.all(s.done_B)

    # Each step picks token `step` from the logits so far, then runs it. The last run's logits are read only by a
    # next chunk: one wasted decode at the end, so that the picking code (slow to compile) appears once, not twice.
    def step_fn(s: DecodeState):
        token_B = pick(s.logits_BxV, s.step)
        out_BxN = s.out_BxN.at[:, s.step].set(jnp.where(s.done_B, -1, token_B))
        logits_BxV, cache = decode_step(params, token_B, s.cache, cfg, method=method, options=options,
                                        adapter_B=adapter_B)
        done_B = s.done_B | is_stop_V[token_B] | (s.step + 1 >= limit_B)
        return split_rows(DecodeState(s.step + 1, logits_BxV, cache, out_BxN, done_B))

    return jax.lax.while_loop(unfinished, step_fn, state)


@partial(jax.jit, static_argnames=("cfg", "method", "options", "cache_size", "max_new_tokens", "greedy"))
def decode(params, packed: PackedPrompts, live_B, limit_B, is_stop_V, temperature, top_k, top_p, key, adapter_B=None,
           *, cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions, cache_size: int,
           max_new_tokens: int, greedy: bool) -> DecodeState:
    """`begin`, then `decode_more` to the end, as one program: what a rollout (`generate` without stop strings, as
    GRPO's) holds at its peak, which `planner.confirm` lowers with `decode_arguments`."""
    state = begin(params, packed, live_B, limit_B, cfg=cfg, method=method, options=options, cache_size=cache_size,
                  max_new_tokens=max_new_tokens)
    return decode_more(params, state, limit_B, is_stop_V, temperature, top_k, top_p, key, max_new_tokens, adapter_B,
                       cfg=cfg, method=method, options=options, greedy=greedy)


def decode_arguments(rows: int, prompt_len: int, vocab_size: int, sharding=None) -> tuple:
    """`decode`'s arguments after the params as ShapeDtypeStructs (placed by `sharding`, if given), for `rows`
    prompts of `prompt_len` tokens (the packing's worst case: one a row): the packed prompts, the live rows, their
    limits, the stop set [V], temperature, top_k, top_p and the key."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    key = jax.eval_shape(jax.random.key, 0)
    packed = PackedPrompts(*(spec((rows, prompt_len), jnp.int32),) * 4, spec((rows,), jnp.int32))
    return (packed, spec((rows,), jnp.bool_), spec((rows,), jnp.int32), spec((vocab_size,), jnp.bool_),
            spec((), jnp.float32), spec((), jnp.int32), spec((), jnp.float32), spec(key.shape, key.dtype))


def rows_bucket(n: int) -> int:
    """The packed rows for n >= 1: n up to 8, then n rounded up to an eighth of its power of two (10, 12, 14, 16,
    20, 24, ...), so padding rows cost at most an eighth more, with at most eight prefill shapes per power of two."""
    step = max(1, bucket(n) // 8)
    return -(-n // step) * step


SHARED_MIN = 8  # prompts sharing at least this many first tokens compute them once (`prefix_trees`)
TREE_ROW = 2048  # the widest packed row a prefix tree may take when the prompts are shorter


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def prefix_trees(prompts: Sequence[Sequence[int]], members: Sequence[int], cap: int,
                 extra: Sequence[int] | None = None, min_shared: int = SHARED_MIN) -> list[tuple[int, list[int]]]:
    """(shared tokens c, prompt indices) per tree: `members` grouped so that each group's prompts begin with the
    same c >= min_shared tokens (c = 0: one prompt alone), each keeps at least one token of its own, at most
    `attention.MAX_BRANCHES` to a group, and c plus every member's rest (and its `extra[i]` tokens) fits in `cap`.
    Greedy over the prompts in sorted order: a prompt joins the open group while the tokens saved do not drop (n
    members sharing c save (n - 1) c)."""
    extra = extra or [0] * len(prompts)
    order = sorted(members, key=lambda i: list(prompts[i]))
    groups: list[tuple[int, list[int]]] = []
    for i in order:
        if groups:
            c, group = groups[-1]
            shared = min(_common(prompts[group[0]], prompts[i]), c if len(group) > 1 else len(prompts[group[0]]) - 1,
                         len(prompts[i]) - 1)
            size = shared + sum(len(prompts[j]) - shared + extra[j] for j in (*group, i))
            if (shared >= min_shared and len(group) * shared >= (len(group) - 1) * c and size <= cap
                    and len(group) < MAX_BRANCHES):
                groups[-1] = (shared, group + [i])
                continue
        groups.append((0, [i]))
    return [(c if len(group) > 1 else 0, group) for c, group in groups]


def pack_prompts(prompts: Sequence[Sequence[int]], batch: int, width: int, prefix: int = 0,
                 adapter_B: np.ndarray | None = None, one_per_row: bool = False, share: bool = False,
                 shape: tuple[int, int] = (0, 0)) -> PackedPrompts:
    """The prompts packed for `kv_cache.prefill_packed` (numpy arrays): rows of `width` tokens filled best-fit by
    decreasing length (`data.batching.pack_plan`), only prompts of one adapter to a row (adapter_B: [batch] slots,
    or None), `rows_bucket` rows; cache rows `batch`, prompt slots `width`; positions from `prefix` (P).

    share: prompts that begin alike (`prefix_trees`) are packed as a prefix tree (`attention.branch_segment`), the
    shared tokens once, in rows of up to max(width, TREE_ROW) tokens; only where no sliding window is narrower
    than that (a branch's slots run past its positions). one_per_row: each prompt alone, right-aligned, as the
    cache holds it (prefix tuning under a sliding window, which counts slots: there a later segment would see fewer
    prefix keys than the cache's decode steps do; Gated DeltaNet layers, whose state is the row's). shape: (the
    fewest rows, the row tokens, which every tree must fit), so that the batches of one call share a shape; (0, 0):
    their buckets."""
    lengths = [len(p) for p in prompts]
    groups: dict[int, list[int]] = {}
    for i in range(len(prompts)):
        groups.setdefault(0 if adapter_B is None else int(adapter_B[i]), []).append(i)
    cap = max(width, TREE_ROW) if share else width
    trees = [tree for members in groups.values()
             for tree in (prefix_trees(prompts, members, cap) if share else [(0, [i]) for i in members])]
    sizes = [c + sum(lengths[i] - c for i in members) for c, members in trees]
    T = shape[1] or (min(bucket(max(sizes), MIN_BUCKET), cap) if share else width)
    rows, row_adapter = [], []
    for slot in groups:
        mine = [t for t, (_, members) in enumerate(trees) if adapter_B is None or int(adapter_B[members[0]]) == slot]
        plan = ([[t] for t in mine] if one_per_row
                else [[mine[j] for j in row] for row in pack_plan([sizes[t] for t in mine], T)])
        rows += plan
        row_adapter += [slot] * len(plan)
    R = max(rows_bucket(len(rows)), shape[0])
    tokens: np.ndarray = np.zeros((R, T), np.int32)
    positions: np.ndarray = np.zeros((R, T), np.int32)
    segments: np.ndarray = np.zeros((R, T), np.int32)
    source: np.ndarray = np.full((batch, width), -1, np.int32)
    last: np.ndarray = np.zeros(batch, np.int32)
    for r, row in enumerate(rows):
        at = T - sizes[row[0]] if one_per_row else 0
        for segment, t in enumerate(row, start=1):
            c, members = trees[t]
            first = prompts[members[0]]
            tokens[r, at: at + c], positions[r, at: at + c], segments[r, at: at + c] = first[:c], \
                prefix + np.arange(c), segment
            shared: np.ndarray = r * T + at + np.arange(c)
            at += c
            for branch, i in enumerate(members, start=1):
                n = lengths[i] - c
                tokens[r, at: at + n], positions[r, at: at + n] = prompts[i][c:], prefix + c + np.arange(n)
                segments[r, at: at + n] = branch_segment(segment, branch) if c else segment
                source[i, width - lengths[i]:] = np.concatenate([shared, r * T + at + np.arange(n)])
                last[i] = r * T + at + n - 1
                at += n
    adapter_R = None if adapter_B is None else np.pad(np.asarray(row_adapter, np.int32), (0, R - len(rows)))
    return PackedPrompts(tokens, positions, segments, source, last, adapter_R)


def _check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if bad:
        raise JaxtuneError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})")


def row_tokens(row_N: np.ndarray, is_stop_V: np.ndarray, include_stop: bool) -> list[int]:
    """A decoded row (-1 once it finished) as its tokens: up to the first -1, ending before (or with) its first stop
    token."""
    tokens: list[int] = []
    for token in row_N.tolist():
        if token < 0:
            break
        if is_stop_V[token]:
            return tokens + [token] if include_stop else tokens
        tokens.append(token)
    return tokens


def generate(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling: SamplingConfig = SamplingConfig(), *, eos_ids: Sequence[int] | None = None,
             stop_token_ids: Sequence[int] = (),
             method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
             include_stop: bool = False, adapter_of_row: Sequence[int] | None = None,
             max_new_tokens_of_row: Sequence[int] | None = None,
             stop_when: Callable[[int, list[int]], bool] | None = None, chunk_steps: int = 16,
             batch_rows: int | None = None) -> list[list[int]]:
    """The new tokens of each prompt: at most `max_new_tokens`, ending before the first EOS or stop token (with
    `include_stop`, ending with it: what a policy-gradient step must credit for stopping).

    prompts: token ids, BOS included if the model wants one. eos_ids: default the model's `eos_token_id`.
    method: the `MethodConfig` whose leaves `params` carries (for its LoRA scale; prefix tuning is found in
    `params`). adapter_of_row: with adapters stacked in `params` (`spine.model.load_adapters`), each prompt's
    adapter slot (0: the base model). max_new_tokens_of_row: each prompt's own limit (default: the sampling's).
    stop_when(prompt index, its new tokens so far): asked on the host after every `chunk_steps` decode steps for
    each row still running; True ends that row's decoding (its tokens then run to the end of that chunk). A
    `StopStrings` (`jaxtune.stop_strings`) then also cuts them where the row's text first held one of its strings
    (ending with the token that completed it with include_stop, before it without), whatever the chunks.
    batch_rows: decode at most this many prompts at once, in their order (the batches share one prefill and one
    decode shape; default all at once). Raises JaxtuneError for no prompts, an empty prompt, an id outside the
    vocabulary, a bad adapter slot or limit, or a prompt that with the largest limit would run past the model's
    context (`max_position_embeddings`).
    """
    if not prompts:
        raise JaxtuneError("no prompts to generate from")
    refuse_context_axis()
    limits = [sampling.max_new_tokens] * len(prompts) if max_new_tokens_of_row is None else max_new_tokens_of_row
    if len(limits) != len(prompts):
        raise JaxtuneError(f"max_new_tokens_of_row has {len(limits)} entries for {len(prompts)} prompts")
    bad = next((i for i, n in enumerate(limits) if isinstance(n, bool) or not isinstance(n, int | np.integer)
                or n < 1), None)
    if bad is not None:
        raise JaxtuneError(f"max_new_tokens_of_row[{bad}] = {limits[bad]!r}: must be an integer >= 1")
    if chunk_steps < 1:
        raise JaxtuneError(f"chunk_steps = {chunk_steps}: must be >= 1")
    if batch_rows is not None and batch_rows < 1:
        raise JaxtuneError(f"batch_rows = {batch_rows}: must be >= 1")
    N = int(max(limits))
    P = prefix_length(params)
    context = cfg.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise JaxtuneError(f"prompt {i} is empty (it needs at least one token, e.g. BOS)")
        _check_ids(prompt, cfg.vocab_size, f"prompt {i}")
        if P + len(prompt) > context:
            raise JaxtuneError(f"prompt {i} has {len(prompt)} tokens{f' after {P} prefix tokens' if P else ''}, "
                               f"more than the model's context of {context} (max_position_embeddings)")
        if P + len(prompt) + N > context:
            raise JaxtuneError(f"prompt {i} has {len(prompt)} tokens{f' after {P} prefix tokens' if P else ''}: "
                               f"with max_new_tokens={N} it would pass the model's context "
                               f"of {context} (max_position_embeddings); lower max_new_tokens")
    stops = tuple(cfg.eos_token_id if eos_ids is None else eos_ids) + tuple(stop_token_ids)
    _check_ids(stops, cfg.vocab_size, "EOS and stop tokens")

    # The bucket never needs to pass the context: every prompt fits in context - P - N (checked above).
    rows = len(prompts) if batch_rows is None else min(batch_rows, len(prompts))
    B = bucket(rows)
    W = min(bucket(max(len(p) for p in prompts), MIN_BUCKET), context - P - N)
    adapter_of_prompt = adapter_slots(params, method, adapter_of_row, len(prompts), len(prompts))
    one_per_row = bool(P and any(cfg.sliding_windows)) or bool(cfg.linear_attention_layers)
    share = not one_per_row and all(w == 0 or w >= max(W, TREE_ROW) for w in cfg.sliding_windows)
    batches = [range(at, min(at + rows, len(prompts))) for at in range(0, len(prompts), rows)]
    adapters = [None if adapter_of_prompt is None else np.pad(adapter_of_prompt[batch], (0, B - len(batch)))
                for batch in batches]

    def pack(shape: tuple[int, int]) -> list[PackedPrompts]:
        return [pack_prompts([prompts[i] for i in batch], B, W, P, adapter_B, one_per_row, share, shape)
                for batch, adapter_B in zip(batches, adapters)]

    packs = pack((0, 0))
    if len(batches) > 1:  # one prefill shape for all: rows of the widest fill, in eighths of its power of two
        fill = max(int(np.max(np.sum(p.segments_RxT > 0, axis=1))) for p in packs)
        T = W if one_per_row else max(MIN_BUCKET, rows_bucket(fill))
        packs = pack((max(p.tokens_RxT.shape[0] for p in pack((0, T))), T))
    is_stop_V: np.ndarray = np.zeros(cfg.vocab_size, bool)
    is_stop_V[list(stops)] = True
    new_tokens = []
    for batch, packed, adapter_B in zip(batches, packs, adapters):
        live_B = np.arange(B) < len(batch)  # rows added to fill the batch bucket start finished
        limit_B = np.pad(np.asarray([limits[i] for i in batch], np.int32), (0, B - len(batch)))
        state = begin(params, packed, live_B, limit_B, cfg=cfg, method=method, options=options,
                      cache_size=P + W + N, max_new_tokens=N)
        new_tokens += decode_rows(params, state, limit_B, is_stop_V, sampling, adapter_B, cfg=cfg, method=method,
                                  options=options, prompt_of_row=batch, include_stop=include_stop,
                                  stop_when=stop_when, chunk_steps=chunk_steps)
    return new_tokens


def decode_rows(params: dict, state: DecodeState, limit_B: np.ndarray, is_stop_V: np.ndarray,
                sampling: SamplingConfig, adapter_B: np.ndarray | None = None, *, cfg: ModelConfig,
                method: MethodConfig | None, options: ForwardOptions, prompt_of_row: Sequence[int],
                include_stop: bool, stop_when: Callable[[int, list[int]], bool] | None,
                chunk_steps: int) -> list[list[int]]:
    """The new tokens of rows [:len(prompt_of_row)] of a just-begun `state` (out_BxN [B, N]), as `generate` returns
    them: decoded by `decode_more` to N in one call, or with `stop_when` in chunks of `chunk_steps` steps, the host
    asking stop_when(prompt_of_row[row], its tokens so far) of each row still running between them; a `StopStrings`
    also cuts each row's tokens where its text first held one of its strings."""
    N = state.out_BxN.shape[1]
    sampling_args = (is_stop_V, np.float32(max(sampling.temperature, 1e-6)), np.int32(sampling.top_k),
                     np.float32(sampling.top_p), jax.random.key(sampling.seed))
    program = dict(cfg=cfg, method=method, options=options, greedy=sampling.greedy)
    until = N if stop_when is None else min(chunk_steps, N)
    state = decode_more(params, state, limit_B, *sampling_args, np.int32(until), adapter_B, **program)
    while stop_when is not None and until < N:  # the host reads each chunk's tokens (one transfer) to end rows
        out_BxN, done_B = host_copy((state.out_BxN, state.done_B))
        done_B = done_B.copy()
        for row in np.flatnonzero(~done_B):
            done_B[row] = stop_when(prompt_of_row[int(row)], row_tokens(out_BxN[row], is_stop_V, False))
        if done_B.all():
            break
        until = min(until + chunk_steps, N)
        state = decode_more(params, state._replace(done_B=done_B), limit_B, *sampling_args, np.int32(until),
                            adapter_B, **program)
    rows = host_copy(state.out_BxN)[:len(prompt_of_row)]
    new_tokens = [row_tokens(row, is_stop_V, include_stop) for row in rows]
    if isinstance(stop_when, StopStrings):
        return [stop_when.cut(i, tokens, include_stop) for i, tokens in zip(prompt_of_row, new_tokens)]
    return new_tokens


def generate_text(params: dict, cfg: ModelConfig, tokenizer: Tokenizer, prompts: Sequence[str | list[dict]],
                  sampling: SamplingConfig = SamplingConfig(),
                  stop_strings: Sequence[str] | Sequence[Sequence[str]] = (),
                  method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
                  adapter_of_row: Sequence[int] | None = None, max_new_tokens_of_row: Sequence[int] | None = None,
                  chunk_steps: int = 16) -> list[str]:
    """The text each prompt continues with, cut before the first of its stop strings (as lm-eval's `generate_until`
    cuts at its `until` strings).

    A text prompt is encoded with special tokens (BOS when the tokenizer adds one); a conversation (a list of
    {"role", "content"} messages) is rendered by the tokenizer's chat template with the assistant's generation
    prompt and encoded without them (the template writes its own), as transformers' `apply_chat_template` does.
    Generation stops at the tokenizer's or the model's EOS. stop_strings: one list for every prompt, or one list per
    prompt; a row whose decoded text holds one stops decoding at the end of that chunk of `chunk_steps` steps, or at
    once where the strings are the same for every row and one token's own text holds one.
    adapter_of_row, max_new_tokens_of_row: as for `generate`.
    """
    if isinstance(prompts, str):
        raise JaxtuneError("generate_text takes a list of prompts, got a single string")
    stops = StopStrings.of(tokenizer, stop_strings, len(prompts))
    eos = {*cfg.eos_token_id, *([tokenizer.eos_id] if tokenizer.eos_id is not None else [])}
    ids = [tokenizer.encode(render_chat(p, tokenizer, add_generation_prompt=True), add_special_tokens=False)
           if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=True) for p in prompts]

    # One stop set for all rows: a token whose own text holds a stop string ends its row at once (kept, then cut).
    new = generate(params, cfg, ids, sampling, eos_ids=sorted(eos), stop_token_ids=stops.token_ids(),
                   include_stop=True, method=method, options=options, adapter_of_row=adapter_of_row,
                   max_new_tokens_of_row=max_new_tokens_of_row, stop_when=stops if stops.any else None,
                   chunk_steps=chunk_steps)
    texts = []
    for row, tokens in enumerate(new):
        text = tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in eos else tokens, skip_special_tokens=True)
        texts.append(stops.cut_text(row, text))
    return texts
