"""Text generation: batched prompts, a key/value cache, greedy or sampled decoding, EOS and stop tokens.

    ids = generate(params, cfg, [[1, 5, 9], [1, 7]], SamplingConfig(max_new_tokens=32))
    texts = generate_text(params, cfg, tokenizer, ["Once upon"], SamplingConfig(temperature=0.7, top_p=0.9))

Prompts are padded on the left (`models/kv_cache.py`); prefill and the decode loop (a `lax.while_loop` until every
row has finished) are one jit, `decode`, compiled once per bucket (batch and prompt length padded to powers of
two; the cache sized by the prompts, not the context). Temperature, top-k, top-p and the seed are traced, greedy
and `max_new_tokens` static; sampling is transformers' order (`filter_logits`). Tokens stop before EOS or a stop token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, SamplingConfig
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.data.formats import render_chat
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.kv_cache import decode_step, prefill, prefix_length, refuse_context_axis


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


def decode_arguments(rows: int, prompt_len: int, vocab_size: int, sharding=None) -> tuple:
    """`decode`'s arguments after the params as ShapeDtypeStructs (placed by `sharding`, if given): the prompts and
    their mask [rows, prompt_len], the live rows, the stop set [V], temperature, top_k, top_p and the key."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    key = jax.eval_shape(jax.random.key, 0)
    return (spec((rows, prompt_len), jnp.int32), spec((rows, prompt_len), jnp.int32), spec((rows,), jnp.bool_),
            spec((vocab_size,), jnp.bool_), spec((), jnp.float32), spec((), jnp.int32), spec((), jnp.float32),
            spec(key.shape, key.dtype))


@partial(jax.jit, static_argnames=("cfg", "method", "options", "cache_size", "max_new_tokens", "greedy"))
def decode(params, tokens_BxT, mask_BxT, live_B, is_stop_V, temperature, top_k, top_p, key, *,
              cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions, cache_size: int,
              max_new_tokens: int, greedy: bool) -> jax.Array:
    """New tokens [B, N]: each row's tokens up to and including its first stop token, then -1. The one program of
    `generate` and of GRPO's rollouts, which `planner.confirm` lowers with `decode_arguments`."""
    B = tokens_BxT.shape[0]

    def pick(logits_BxV, step):
        if greedy:
            return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        return sample(logits_BxV, jax.random.fold_in(key, step), temperature, top_k, top_p)

    logits_BxV, cache = prefill(params, tokens_BxT, cfg, mask_BxT, cache_size=cache_size, method=method,
                                options=options)

    def unfinished(carry):
        step, _, _, _, done_B = carry
        return (step < max_new_tokens) & ~jnp.all(done_B)

    # Each step picks token `step` from the logits so far, then runs it. The last run's logits are never read:
    # one wasted decode, so that the picking code (slow to compile when sampling) appears once, not twice.
    def step_fn(carry):
        step, logits_BxV, cache, out_BxN, done_B = carry
        token_B = pick(logits_BxV, step)
        out_BxN = out_BxN.at[:, step].set(jnp.where(done_B, -1, token_B))
        logits_BxV, cache = decode_step(params, token_B, cache, cfg, method=method, options=options)
        return step + 1, logits_BxV, cache, out_BxN, done_B | is_stop_V[token_B]

    out_BxN = jnp.full((B, max_new_tokens), -1, jnp.int32)
    carry = (jnp.asarray(0, jnp.int32), logits_BxV, cache, out_BxN, ~live_B)
    return jax.lax.while_loop(unfinished, step_fn, carry)[3]


def _check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if bad:
        raise JaxtuneError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})")


def generate(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling: SamplingConfig = SamplingConfig(), *, eos_ids: Sequence[int] | None = None,
             stop_token_ids: Sequence[int] = (),
             method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions(),
             include_stop: bool = False) -> list[list[int]]:
    """The new tokens of each prompt: at most `max_new_tokens`, ending before the first EOS or stop token (with
    `include_stop`, ending with it: what a policy-gradient step must credit for stopping).

    prompts: token ids, BOS included if the model wants one. eos_ids: default the model's `eos_token_id`.
    method: the `MethodConfig` whose leaves `params` carries (for its LoRA scale; prefix tuning is found in
    `params`). Raises JaxtuneError for no prompts, an empty prompt, an id outside the vocabulary, or a prompt
    that with `max_new_tokens` would run past the model's context (`max_position_embeddings`).
    """
    if not prompts:
        raise JaxtuneError("no prompts to generate from")
    refuse_context_axis()
    P = prefix_length(params)
    context = cfg.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise JaxtuneError(f"prompt {i} is empty (it needs at least one token, e.g. BOS)")
        _check_ids(prompt, cfg.vocab_size, f"prompt {i}")
        if P + len(prompt) > context:
            raise JaxtuneError(f"prompt {i} has {len(prompt)} tokens{f' after {P} prefix tokens' if P else ''}, "
                               f"more than the model's context of {context} (max_position_embeddings)")
        if P + len(prompt) + sampling.max_new_tokens > context:
            raise JaxtuneError(f"prompt {i} has {len(prompt)} tokens{f' after {P} prefix tokens' if P else ''}: "
                               f"with max_new_tokens={sampling.max_new_tokens} it would pass the model's context "
                               f"of {context} (max_position_embeddings); lower max_new_tokens")
    stops = tuple(cfg.eos_token_id if eos_ids is None else eos_ids) + tuple(stop_token_ids)
    _check_ids(stops, cfg.vocab_size, "EOS and stop tokens")

    # The bucket never needs to pass the context: every prompt fits in context - P - max_new_tokens (checked above).
    B = bucket(len(prompts))
    T = min(bucket(max(len(p) for p in prompts), MIN_BUCKET), context - P - sampling.max_new_tokens)
    tokens_BxT, mask_BxT = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for row, prompt in enumerate(prompts):  # left padding: every row's last prompt token at index T - 1
        tokens_BxT[row, T - len(prompt):] = prompt
        mask_BxT[row, T - len(prompt):] = 1
    live_B = np.arange(B) < len(prompts)  # rows added to fill the batch bucket start finished
    is_stop_V = np.zeros(cfg.vocab_size, bool)
    is_stop_V[list(stops)] = True
    out_BxN = decode(
        params, tokens_BxT, mask_BxT, live_B, is_stop_V, np.float32(max(sampling.temperature, 1e-6)),
        np.int32(sampling.top_k), np.float32(sampling.top_p), jax.random.key(sampling.seed),
        cfg=cfg, method=method, options=options, cache_size=P + T + sampling.max_new_tokens,
        max_new_tokens=sampling.max_new_tokens, greedy=sampling.greedy)
    results = []
    for row in np.asarray(out_BxN)[: len(prompts)]:  # the one device -> host transfer
        tokens = []
        for token in row.tolist():
            if token < 0:
                break
            if is_stop_V[token]:
                tokens += [token] if include_stop else []
                break
            tokens.append(token)
        results.append(tokens)
    return results


def generate_text(params: dict, cfg: ModelConfig, tokenizer: Tokenizer, prompts: Sequence[str | list[dict]],
                  sampling: SamplingConfig = SamplingConfig(), stop_strings: Sequence[str] = (),
                  method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions()) -> list[str]:
    """The text each prompt continues with, cut before the first of `stop_strings`.

    A text prompt is encoded with special tokens (BOS when the tokenizer adds one); a conversation (a list of
    {"role", "content"} messages) is rendered by the tokenizer's chat template with the assistant's generation
    prompt and encoded without them (the template writes its own), as transformers' `apply_chat_template` does.
    Generation stops at the tokenizer's or the model's EOS. Stop strings are found in the decoded text after
    generation, so they shorten the answer, not the decode loop.
    """
    if isinstance(prompts, str):
        raise JaxtuneError("generate_text takes a list of prompts, got a single string")
    eos = {*cfg.eos_token_id, *([tokenizer.eos_id] if tokenizer.eos_id is not None else [])}
    ids = [tokenizer.encode(render_chat(p, tokenizer, add_generation_prompt=True), add_special_tokens=False)
           if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    new = generate(params, cfg, ids, sampling, eos_ids=sorted(eos), method=method, options=options)
    texts = []
    for tokens in new:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop_strings if s and s in text]
        texts.append(text[: min(cuts)] if cuts else text)
    return texts
