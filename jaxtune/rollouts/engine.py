"""The rollout engine: G samples of each prompt decoded by S slots over a paged key/value cache (`paged_cache.py`), a
finished row's slot taking the next pending sample inside one jitted `lax.while_loop` (`run`, which says how).

    out = sample_groups(params, cfg, prompts, 4, SamplingConfig(max_new_tokens=256, temperature=1.0),
                        pool=PagePool(slots=16, page_size=16, num_pages=512))
    out.tokens  # len(prompts) * 4 lists, sample g * 4 + j the j-th of prompt g (GRPO's `repeated` rows)
Memory is the pool (`PagePool`; what happens when it runs short), not rows x max_new_tokens: pages are taken as rows
grow and go back as they end. With stop strings (`stop_when`) the loop runs in chunks (`advance`, one program for any
chunk), the host ending between them the samples whose text holds one. `sample_groups` says what is refused. On a
mesh and across processes: one SPMD program, the slots split over the batch axes (`placed` says how)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.errors import JaxtuneError, check_range
from jaxtune.generation import pack_prompts, row_tokens, sample
from jaxtune.models.kv_cache import PackedPrompts, prefill_packed, prefix_length, refuse_context_axis
from jaxtune.parallel.distributed import host_copy
from jaxtune.parallel.rules import constrain
from jaxtune.rollouts.paged_cache import (
    empty_pool,
    paged_decode_step,
    pool_heads,
    refuse_unpaged,
    return_pages,
    take_pages,
    write_prompts,
)
from jaxtune.stop_strings import StopStrings


@dataclass(frozen=True)
class PagePool:
    """The engine's shape. slots: S rows decoding together. page_size: tokens a page holds. num_pages: the pool (0:
    the prompts' pages plus every slot's largest limit, rounded up to a power of two: no sample ever waits). All
    three are static: a new value compiles a new program.

    The pool running short: a sample is admitted only when the free pages, less those the running rows may still
    take, cover its own limit's pages (`pages_for`), so a running row never waits for a page; a pending sample waits
    (and the ones after it: admission is in order) until rows end. Admission reserves, but rows take pages as they
    grow: one ending early (EOS) hands the rest of its reservation back at once. Every prompt's pages are held from
    the start (all are prefilled at once) until its last sample ends. A sample that could not run even alone (its
    pages beside those of the prompts not yet done) is refused before anything runs, in one line."""

    slots: int = 16
    page_size: int = 16
    num_pages: int = 0

    def __post_init__(self):
        check_range("slots", self.slots, 1)
        check_range("page_size", self.page_size, 1)
        check_range("num_pages", self.num_pages, 0)


class Rollouts(NamedTuple):
    """tokens: each sample's new tokens (group-major), ending before its EOS, stop token or stop string (with
    include_stop, with it: `StopStrings.cut`). free_pages: the pool's free pages after the run (all of them: every
    page went back). num_pages: the pool. peak_pages: the most pages in use at once (prompts included). steps:
    decode steps run."""

    tokens: list[list[int]]
    free_pages: int
    num_pages: int
    peak_pages: int
    steps: int


class EngineState(NamedTuple):
    """The loop's carry. Slots: sample_S (-1 idle), t_S (its tokens picked so far), reserve_S (pages it may still
    take), table_SxM (its pages: Mp prompt columns, then its own), logits_SxV (for its next token). The pool: k, v,
    free_NP, peak (most pages in use). Samples: next_sample (the first pending), group_left_G (unfinished samples
    per prompt: its pages go back at 0), out_NxN (tokens, -1 past the end). The prompts: length_G, logits_GxV (for
    a sample's first token)."""

    step: jax.Array
    sample_S: jax.Array
    t_S: jax.Array
    reserve_S: jax.Array
    table_SxM: jax.Array
    logits_SxV: jax.Array
    k: jax.Array
    v: jax.Array
    free_NP: jax.Array
    peak: jax.Array
    next_sample: jax.Array
    group_left_G: jax.Array
    out_NxN: jax.Array
    length_G: jax.Array
    logits_GxV: jax.Array


def pages_for(limit, page_size: int):
    """Pages a sample of `limit` new tokens writes: ceil((limit - 1) / ps) (its last token is never decoded)."""
    return (jnp.maximum(limit - 1, 0) + page_size - 1) // page_size


def admit(s: EngineState, prompt_table_GxMp, group_N, limit_N, page_size: int) -> EngineState:
    """Idle slots take the next pending samples, in order, while the free pages cover their reservations."""
    (S, M), N, NP, Mp = s.table_SxM.shape, limit_N.shape[0], s.free_NP.shape[0], prompt_table_GxMp.shape[1]
    idle_S = s.sample_S < 0
    candidate_S = s.next_sample + jnp.cumsum(idle_S) - 1
    limit_S = jnp.where(idle_S & (candidate_S < N), limit_N[jnp.clip(candidate_S, 0, N - 1)], 0)
    need_S = pages_for(limit_S, page_size)
    budget = jnp.sum(s.free_NP) - jnp.sum(s.reserve_S)
    admit_S = idle_S & (limit_S > 0) & (jnp.cumsum(need_S) <= budget)  # in order: a prefix of the idle slots
    group_S = group_N[jnp.clip(candidate_S, 0, N - 1)]
    own_SxMo = jnp.full((S, M - Mp), NP, jnp.int32)
    table_SxM = jnp.where(admit_S[:, None], jnp.concatenate([prompt_table_GxMp[group_S], own_SxMo], 1), s.table_SxM)
    return s._replace(sample_S=jnp.where(admit_S, candidate_S, s.sample_S),
                      t_S=jnp.where(admit_S, 0, s.t_S), reserve_S=jnp.where(admit_S, need_S, s.reserve_S),
                      table_SxM=table_SxM, logits_SxV=jnp.where(admit_S[:, None], s.logits_GxV[group_S], s.logits_SxV),
                      next_sample=s.next_sample + jnp.sum(admit_S, dtype=jnp.int32))


def release(s: EngineState, done_S, prompt_table_GxMp, group_N) -> EngineState:
    """The slots `done_S` idle: their own pages go back, and a prompt's pages with its last sample."""
    NP, Mp, G = s.free_NP.shape[0], prompt_table_GxMp.shape[1], prompt_table_GxMp.shape[0]
    free_NP = return_pages(s.free_NP, jnp.where(done_S[:, None], s.table_SxM[:, Mp:], NP))
    group_S = group_N[jnp.maximum(s.sample_S, 0)]
    left_G = s.group_left_G - jnp.zeros(G, jnp.int32).at[group_S].add(done_S.astype(jnp.int32))
    ended_G = (left_G == 0) & (s.group_left_G > 0)
    free_NP = return_pages(free_NP, jnp.where(ended_G[:, None], prompt_table_GxMp, NP))
    return s._replace(sample_S=jnp.where(done_S, -1, s.sample_S), reserve_S=jnp.where(done_S, 0, s.reserve_S),
                      free_NP=free_NP, group_left_G=left_G)


def placed(s: EngineState) -> EngineState:
    """`s` laid out on the mesh in context (`rules.constrain`; itself without one): the slots (their rows of the
    decode step, its tables, logits and counters) split over the batch axes as the padded decode splits its rows
    (`generation.split_rows`), the pool's heads over tensor and its pages on every data-parallel device, the
    samples' bookkeeping (out_NxN, free_NP, group_left_G) whole on every device.

    On a mesh (called under it, `spine.run.traced_on`, as a run's batch function is) the engine is one SPMD program over
    the policy's weights as the run splits them (nothing gathered to one device; a layer's kernels gathered where used,
    as the padded decode and the training step gather them): the slots are split over the batch axes as the padded
    decode splits its rows, each device running the decode step of its own, and the pool's heads over tensor. The pool's
    pages are not split over the data-parallel devices: a page table names pages anywhere in the pool, a group's prompt
    pages are read by samples on every device, and a free list per device would hold each device's share of the pool (a
    prompt's pages copied to every device one of its samples runs on) and tie a sample to the device its slot is on;
    instead every device holds the whole pool (its heads), and a step's new keys and values (S x K x hd a layer) are
    gathered to every device's copy. The admission, the free list and the samples' tokens are small and held whole.
    Across processes (`jax.distributed`) the same program runs on every process over all their devices, as the padded
    decode does: the prompts, the key and the pool's layout are the same on each, the `lax.while_loop`'s condition (a
    busy slot anywhere) is one global value, and the tokens come back to every process with `host_copy` (the host's stop
    strings then end the same samples on each)."""
    slots = lambda a: constrain(a, ("batch",) + (None,) * (a.ndim - 1))  # noqa: E731
    whole = lambda a: constrain(a, (None,) * a.ndim)  # noqa: E731
    return s._replace(sample_S=slots(s.sample_S), t_S=slots(s.t_S), reserve_S=slots(s.reserve_S),
                      table_SxM=slots(s.table_SxM), logits_SxV=slots(s.logits_SxV), k=pool_heads(s.k),
                      v=pool_heads(s.v), free_NP=whole(s.free_NP), group_left_G=whole(s.group_left_G),
                      out_NxN=whole(s.out_NxN), length_G=whole(s.length_G), logits_GxV=whole(s.logits_GxV))


@partial(jax.jit, static_argnames=("cfg", "method", "options", "slots", "page_size", "num_pages", "max_new_tokens"))
def start(params, packed: PackedPrompts, prompt_table_GxMp, group_N, limit_N, *, cfg: ModelConfig,
          method: MethodConfig | None, options: ForwardOptions, slots: int, page_size: int, num_pages: int,
          max_new_tokens: int) -> EngineState:
    """The state before the first token: the distinct prompts prefilled once, packed (`kv_cache.prefill_packed`),
    their keys and values written into their pages, the first samples admitted. Arguments as `run`'s."""
    S, ps, NP, N = slots, page_size, num_pages, limit_N.shape[0]
    G, W = packed.source_BxW.shape
    M = prompt_table_GxMp.shape[1] + max(1, -(-(max_new_tokens - 1) // ps))
    logits_GxV, dense = prefill_packed(params, packed, cfg, cache_size=W, method=method, options=options)
    length_G = jnp.sum(packed.source_BxW >= 0, axis=1, dtype=jnp.int32)
    k, v = write_prompts(*empty_pool(cfg, NP, ps, jnp.dtype(options.compute_dtype)), dense.k, dense.v,
                         prompt_table_GxMp, length_G)
    in_prompts = jnp.zeros(NP, bool).at[prompt_table_GxMp.reshape(-1)].set(True, mode="drop")
    state = EngineState(
        step=jnp.asarray(0, jnp.int32), sample_S=jnp.full(S, -1, jnp.int32), t_S=jnp.zeros(S, jnp.int32),
        reserve_S=jnp.zeros(S, jnp.int32), table_SxM=jnp.full((S, M), NP, jnp.int32),
        logits_SxV=jnp.zeros((S, logits_GxV.shape[1]), logits_GxV.dtype), k=k, v=v, free_NP=~in_prompts,
        peak=jnp.sum(in_prompts, dtype=jnp.int32), next_sample=jnp.asarray(0, jnp.int32),
        group_left_G=jnp.zeros(G, jnp.int32).at[group_N].add((limit_N > 0).astype(jnp.int32)),
        out_NxN=jnp.full((N, max_new_tokens), -1, jnp.int32), length_G=length_G, logits_GxV=logits_GxV)
    return placed(admit(placed(state), prompt_table_GxMp, group_N, limit_N, ps))


@partial(jax.jit, static_argnames=("cfg", "method", "options", "page_size", "greedy"), donate_argnames=("state",))
def advance(params, state: EngineState, prompt_table_GxMp, group_N, limit_N, stopped_N, is_stop_V, temperature, top_k,
            top_p, key, until, *, cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions,
            page_size: int, greedy: bool) -> EngineState:
    """`state` after steps until every sample has ended or step `until` (a traced int32: chunks of any length share
    the program). First the running samples `stopped_N` [N] marks (the host found a stop string in their text) end:
    their slots and pages are released and the next pending samples admitted. Arguments otherwise as `run`'s."""
    (S, M), ps, NP, N = state.table_SxM.shape, page_size, state.free_NP.shape[0], limit_N.shape[0]
    Mp = prompt_table_GxMp.shape[1]
    Mo = M - Mp
    slot_X = jnp.arange(M * ps)
    admit_ = lambda s: admit(s, prompt_table_GxMp, group_N, limit_N, ps)  # noqa: E731
    release_ = lambda s, done_S: release(s, done_S, prompt_table_GxMp, group_N)  # noqa: E731

    def pick(logits_SxV, sample_S, t_S):
        if greedy:
            return jnp.argmax(logits_SxV, axis=-1).astype(jnp.int32)
        keys_S = jax.vmap(lambda n, t: jax.random.fold_in(jax.random.fold_in(key, n), t))(sample_S, t_S)
        return jax.vmap(lambda logits_V, k_: sample(logits_V[None], k_, temperature, top_k, top_p)[0])(
            logits_SxV, keys_S)

    def step_fn(s: EngineState) -> EngineState:
        busy_S = s.sample_S >= 0
        sample_S = jnp.maximum(s.sample_S, 0)
        token_S = pick(s.logits_SxV, sample_S, s.t_S)
        out_NxN = s.out_NxN.at[jnp.where(busy_S, s.sample_S, N), s.t_S].set(token_S, mode="drop")
        done_S = busy_S & (is_stop_V[token_S] | (s.t_S + 1 >= limit_N[sample_S]))
        running_S = busy_S & ~done_S
        # the running rows write token t at own page t // ps, offset t % ps; a page taken when t reaches a new one
        column_S = Mp + jnp.minimum(s.t_S // ps, Mo - 1)
        new_page_S, free_NP = take_pages(s.free_NP, running_S & (s.t_S % ps == 0))
        table_SxM = s.table_SxM.at[jnp.arange(S), column_S].set(
            jnp.where(new_page_S < NP, new_page_S, s.table_SxM[jnp.arange(S), column_S]))
        length_S = s.length_G[group_N[sample_S]]
        seen_SxX = (slot_X < length_S[:, None]) | ((slot_X >= Mp * ps) & (slot_X < Mp * ps + s.t_S[:, None]))
        write_S = jnp.where(running_S, table_SxM[jnp.arange(S), column_S], NP)
        logits_SxV, k, v = paged_decode_step(params, token_S, length_S + s.t_S, table_SxM, seen_SxX, write_S,
                                             s.t_S % ps, s.k, s.v, cfg, method, options)
        s = s._replace(step=s.step + 1, t_S=s.t_S + 1,
                       reserve_S=jnp.where(running_S, s.reserve_S - (new_page_S < NP), 0), table_SxM=table_SxM,
                       logits_SxV=logits_SxV, k=k, v=v, free_NP=free_NP,
                       peak=jnp.maximum(s.peak, NP - jnp.sum(free_NP)), out_NxN=out_NxN)
        return placed(admit_(release_(s, done_S)))

    def busy(s: EngineState):
        return jnp.any(s.sample_S >= 0) & (s.step < until) & (s.step < N * s.out_NxN.shape[1])

    stopped_S = (state.sample_S >= 0) & stopped_N[jnp.maximum(state.sample_S, 0)]
    return placed(jax.lax.while_loop(busy, step_fn, placed(admit_(release_(state, stopped_S)))))


@partial(jax.jit, static_argnames=("cfg", "method", "options", "slots", "page_size", "num_pages", "max_new_tokens",
                                   "greedy"))
def run(params, packed: PackedPrompts, prompt_table_GxMp, group_N, limit_N, is_stop_V, temperature, top_k, top_p,
        key, *, cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions, slots: int, page_size: int,
        num_pages: int, max_new_tokens: int, greedy: bool) -> EngineState:
    """The rollouts of N samples: the engine's whole program (`start`, then `advance` to the end).

    The distinct prompts are prefilled once, packed (`kv_cache.prefill_packed`), and their keys and values written
    into pages; then each step picks every busy slot's token (greedy, or `generation.sample`: transformers' filter
    order; the key fold_in(fold_in(key, sample), t), so a sample's tokens do not depend on the slots), decodes the
    slots still running (`paged_cache.paged_decode_step`), hands a finished row's pages back and admits pending
    samples into the idle slots, in order (`PagePool`). A slot's page table: Mp columns of its prompt's pages, shared
    by the G samples (referenced, never copied), then its own, so decoding starts on a fresh page (the tail of a
    prompt's last page is never written: < 1 page a prompt, not a sample). A prompt's pages go back when its last
    sample ends, a sample's own as it ends.

    packed: the G' distinct prompts (`generation.pack_prompts`, cache rows G', width W, no prefix); prompt_table_GxMp:
    each prompt's pages (Mp = ceil(W / ps) columns, NP: none; the host lays them out, the rest of the pool free).
    group_N: each sample's prompt; limit_N: its limit (0: a padding sample, never run; pending samples in order).
    Returns the final `EngineState` (out_NxN, free_NP, peak, step).
    """
    state = start(params, packed, prompt_table_GxMp, group_N, limit_N, cfg=cfg, method=method, options=options,
                  slots=slots, page_size=page_size, num_pages=num_pages, max_new_tokens=max_new_tokens)
    N = limit_N.shape[0]
    return advance(params, state, prompt_table_GxMp, group_N, limit_N, jnp.zeros(N, bool), is_stop_V, temperature,
                   top_k, top_p, key, jnp.int32(N * max_new_tokens), cfg=cfg, method=method, options=options,
                   page_size=page_size, greedy=greedy)


def sample_groups(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], group_size: int = 1,
             sampling: SamplingConfig = SamplingConfig(), *, pool: PagePool = PagePool(),
             eos_ids: Sequence[int] | None = None, stop_token_ids: Sequence[int] = (), include_stop: bool = False,
             method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
             max_new_tokens_of_sample: Sequence[int] | None = None,
             stop_when: Callable[[int, list[int]], bool] | None = None, chunk_steps: int = 16) -> Rollouts:
    """`group_size` samples of each prompt, decoded by the engine (`run`): the same tokens as `generation.generate`
    on the prompts each repeated `group_size` times, greedy; sampled, from the same distribution (other keys).

    prompts: the distinct prompts' token ids (BOS included if the model wants one). max_new_tokens_of_sample: each
    sample's limit, group-major (len(prompts) * group_size; default the sampling's). eos_ids: default the model's.
    method: the `MethodConfig` whose leaves `params` carries (LoRA runs unmerged). stop_when(sample, its new tokens
    so far): as `generation.generate`'s, asked on the host after every `chunk_steps` steps for each sample still
    running with new tokens; True ends the sample at the next step (its slot and pages freed, the next pending
    sample admitted), its tokens running to the end of that chunk; a `StopStrings` (`jaxtune.stop_strings`) then
    cuts them where its text first held one of its strings (with include_stop, ending with the token that completed
    it), so the tokens are `generate`'s with the same `stop_when`. Without it, one call runs to the end.
    Raises JaxtuneError for no or an empty prompt, an id outside the vocabulary, a bad limit or chunk_steps, a row past
    the model's context, a sample the pool cannot hold (`PagePool`); refused for now: the caches
    `paged_cache.refuse_unpaged` names (sliding windows, latent attention, Gated DeltaNet, Gemma 4's layers), prefix
    tuning, per-row adapter stacks (one `method` for every row) and a mesh's context axis. Called under a mesh
    (`spine.run.traced_on`), with `params` in the run's shardings, on one process or several: the module docstring
    says how the work is split.
    """
    refuse_context_axis()
    refuse_unpaged(cfg)
    if prefix_length(params):
        raise JaxtuneError("the rollout engine does not hold prefix tuning's virtual tokens: use jaxtune.generate")
    if not prompts:
        raise JaxtuneError("no prompts to roll out from")
    check_range("group_size", group_size, 1)
    N = len(prompts) * group_size
    limits = ([sampling.max_new_tokens] * N if max_new_tokens_of_sample is None
              else [int(n) for n in max_new_tokens_of_sample])
    if len(limits) != N:
        raise JaxtuneError(f"max_new_tokens_of_sample has {len(limits)} entries for {N} samples "
                           f"({len(prompts)} prompts x group_size {group_size})")
    if min(limits) < 1:
        raise JaxtuneError(f"max_new_tokens_of_sample[{limits.index(min(limits))}] = {min(limits)}: must be >= 1")
    if chunk_steps < 1:
        raise JaxtuneError(f"chunk_steps = {chunk_steps}: must be >= 1")
    stops = tuple(cfg.eos_token_id if eos_ids is None else eos_ids) + tuple(stop_token_ids)
    for i, p in enumerate([*prompts, stops]):
        what = "EOS and stop tokens" if i == len(prompts) else f"prompt {i}"
        if i < len(prompts) and len(p) == 0:
            raise JaxtuneError(f"prompt {i} is empty (it needs at least one token, e.g. BOS)")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise JaxtuneError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    longest = [max(limits[g * group_size: (g + 1) * group_size]) for g in range(len(prompts))]
    for g, p in enumerate(prompts):
        if len(p) + longest[g] > cfg.max_position_embeddings:
            raise JaxtuneError(f"prompt {g} has {len(p)} tokens: with {longest[g]} new ones it would pass the model's "
                               f"context of {cfg.max_position_embeddings} (max_position_embeddings)")

    ps, S = pool.page_size, pool.slots
    G = bucket(len(prompts))
    W = bucket(max(map(len, prompts)), MIN_BUCKET)
    Mp = -(-W // ps)
    max_new = bucket(max(limits), MIN_BUCKET)
    prompt_pages = [-(-len(p) // ps) for p in prompts]
    own = [int(pages_for(n, ps)) for n in limits]
    NP = pool.num_pages or bucket(sum(prompt_pages) + S * int(pages_for(max_new, ps)))
    waiting = np.cumsum(prompt_pages[::-1])[::-1]  # a sample of prompt g runs alone beside prompts g.. only
    for i, n in enumerate(own):
        if n + waiting[i // group_size] > NP:
            raise JaxtuneError(f"the page pool of {NP} pages of {ps} tokens cannot hold sample {i}: its limit of "
                               f"{limits[i]} tokens takes {n} pages beside the {waiting[i // group_size]} of the "
                               f"prompts not yet done; raise PagePool.num_pages to {n + waiting[i // group_size]}")
    table: np.ndarray = np.full((G, Mp), NP, np.int32)
    first = np.concatenate([[0], np.cumsum(prompt_pages)])
    for g, n in enumerate(prompt_pages):
        table[g, :n] = first[g] + np.arange(n)
    Nb = bucket(N)
    group_N = np.pad(np.repeat(np.arange(len(prompts), dtype=np.int32), group_size), (0, Nb - N))
    limit_N = np.pad(np.asarray(limits, np.int32), (0, Nb - N))
    is_stop_V: np.ndarray = np.zeros(cfg.vocab_size, bool)
    is_stop_V[list(stops)] = True
    packed = pack_prompts(prompts, G, W)
    program = dict(cfg=cfg, method=method, options=options)
    sampling_args = (is_stop_V, np.float32(max(sampling.temperature, 1e-6)), np.int32(sampling.top_k),
                     np.float32(sampling.top_p), jax.random.key(sampling.seed))
    shape = dict(slots=S, page_size=ps, num_pages=NP, max_new_tokens=max_new)
    if stop_when is None:
        state = run(params, packed, table, group_N, limit_N, *sampling_args, **program, **shape,
                    greedy=sampling.greedy)
    else:
        state = start(params, packed, table, group_N, limit_N, **program, **shape)
        step = 0
        stopped_N: np.ndarray = np.zeros(Nb, bool)
        checked_N: np.ndarray = np.zeros(Nb, np.int64)  # the tokens of each sample stop_when has seen
        while True:  # the host reads each chunk's tokens (one transfer) to end the samples whose text says so
            state = advance(params, state, table, group_N, limit_N, stopped_N, *sampling_args,
                            np.int32(step + chunk_steps), **program, page_size=ps, greedy=sampling.greedy)
            out_NxN, sample_S, step = host_copy((state.out_NxN, state.sample_S, state.step))
            if not (sample_S >= 0).any():
                break
            stopped_N = np.zeros(Nb, bool)
            for n in sample_S[sample_S >= 0]:
                tokens = row_tokens(out_NxN[n], is_stop_V, False)
                if len(tokens) > checked_N[n]:
                    checked_N[n], stopped_N[n] = len(tokens), stop_when(int(n), tokens)
    out_NxN, free_NP, peak, steps = host_copy((state.out_NxN, state.free_NP, state.peak, state.step))
    samples = [row_tokens(row, is_stop_V, include_stop) for row in out_NxN[:N]]
    if isinstance(stop_when, StopStrings):
        samples = [stop_when.cut(n, tokens, include_stop) for n, tokens in enumerate(samples)]
    return Rollouts(samples, int(free_NP.sum()), NP, int(peak), int(steps))
