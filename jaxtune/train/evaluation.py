"""Held-out scores of a file (`jaxtune eval`): loss and perplexity on SFT data (`evaluate_file`: the mean of -log p
over every completion token, sums then one ratio); pairwise accuracy on preference data (`evaluate_preference_file`).

Scores are sums over examples, so batches may come in any order: they go fullest first, each padded to the
power-of-two bucket of its longest row (`data.batching.eval_batches`). `max_seq_len` (default the model's context)
only caps lengths (the drop / truncate policy): a file of short rows runs at short-row shapes and memory.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxtune.config import ForwardOptions
from jaxtune.data.batching import eval_batches, padded_length
from jaxtune.data.formats import PreferenceExample, load_preference_examples, load_sft_examples
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError, check_range
from jaxtune.models.reward_model import is_reward_model
from jaxtune.objectives import dpo
from jaxtune.objectives import reward as reward_objective
from jaxtune.objectives.base import Context
from jaxtune.objectives.dpo import pair_batch
from jaxtune.objectives.sft import eval_terms as sft_terms
from jaxtune.objectives.sft import perplexity
from jaxtune.spine.model import load_model_with_adapter, load_reward_model


def evaluate(eval_step, params: dict, batches: list[dict]) -> tuple[float, float, int]:
    """(mean completion-token loss, perplexity, tokens) over all batches; eval_step(params, batch) -> {"loss",
    "tokens"} sums (SFT's `eval_terms`)."""
    sums = [eval_step(params, batch) for batch in batches]
    total = sum(float(s["loss"]) for s in sums)
    count = int(sum(float(s["tokens"]) for s in sums))
    if count == 0:
        raise JaxtuneError("evaluation data has no completion tokens")
    return total / count, perplexity(total / count), count


def pair_eval_batches(pairs: list[PreferenceExample], batch_size: int, seq_len: int) -> list[dict]:
    """Pair batches for scoring (`dpo.pair_batch`, [2 * batch_size, T] arrays): the longest pairs first, T the
    `padded_length` of the batch's longest row (its input positions: len(prompt + completion) - 1)."""
    positions = lambda p: len(p.prompt) + max(len(p.chosen), len(p.rejected)) - 1
    pairs = sorted(pairs, key=positions, reverse=True)
    chunks = [pairs[start:start + batch_size] for start in range(0, len(pairs), batch_size)]
    return [pair_batch(chunk, batch_size, padded_length(positions(chunk[0]), seq_len)) for chunk in chunks]


def evaluate_file(model: str | Path, data: str | Path, adapter: str | Path | None = None,
                  max_seq_len: int | None = None, batch_size: int = 8,
                  options: ForwardOptions = ForwardOptions(), base: str = "as-trained", log=None,
                  chat: bool = False) -> dict:
    """{"loss", "perplexity", "tokens", "examples", "dropped"} of a model (with an optional PEFT adapter) on a
    JSONL file; chat: prompt/completion and alpaca records through the chat template (`[data] apply_chat_template`).

    max_seq_len: the cap (default the model's context, max_position_embeddings); examples whose prompt does not fit
    are dropped and counted, longer ones truncated. Batches are padded to their longest row's bucket, not to the
    cap; examples are packed, which leaves each example's logits unchanged. base: for a QLoRA adapter, "as-trained"
    (its quantised base) or "float" (see `load_model_with_adapter`).
    """
    check_range("batch_size", batch_size, 1)
    cfg, params, method = load_model_with_adapter(model, adapter, base=base, log=log)
    tokenizer = load_tokenizer(model)
    seq_len = max_seq_len or cfg.max_position_embeddings
    examples, stats = load_sft_examples(data, tokenizer, seq_len, as_chat=chat)
    batches = eval_batches(examples, batch_size, seq_len)
    terms = jax.jit(lambda params, batch: sft_terms(Context(cfg, method, options))(params, None, batch))
    loss, ppl, tokens = evaluate(terms, params, batches)
    return {"loss": loss, "perplexity": ppl, "tokens": tokens, "examples": len(examples),
            "dropped": stats.dropped_prompt_too_long + stats.dropped_empty}


def evaluate_preference_file(model: str | Path, data: str | Path, adapter: str | Path | None = None,
                             max_seq_len: int | None = None, batch_size: int = 8,
                             options: ForwardOptions = ForwardOptions(), base: str = "as-trained", log=None) -> dict:
    """Pairwise scores of {prompt, chosen, rejected} pairs: {"kind", "pairs", "accuracy", "margin", "loss",
    "dropped"}, means over pairs.

    kind "reward": `model` is a reward model (as `objective = "reward"` exports it); accuracy is the share of pairs
    whose chosen completion scores higher, margin the mean score difference, loss the Bradley-Terry loss.
    kind "policy": `model` + `adapter` against `model` alone as the reference (DPO's implicit reward); accuracy is
    the share of pairs with log pi/ref(chosen) > log pi/ref(rejected), margin the mean of that difference (nats),
    loss DPO's sigmoid loss at beta = 1.
    """
    check_range("batch_size", batch_size, 1)
    reward = is_reward_model(model)
    if reward:
        if adapter is not None:
            raise JaxtuneError(f"{model}: a reward model takes no --adapter (its adapters are merged on export)")
        cfg, params = load_reward_model(model)
        terms = reward_objective.eval_terms(Context(cfg, None, options))
    else:
        if adapter is None:
            raise JaxtuneError(f"{data}: preference data needs a reward model, or --adapter to score a policy "
                               f"against {model} as the reference")
        cfg, params, method = load_model_with_adapter(model, adapter, base=base, log=log)
        terms = dpo.eval_terms(Context(cfg, method, options, dpo.PreferenceConfig(beta=1.0)))
    evaluate_pair = jax.jit(lambda params, batch: terms(params, None, batch))
    seq_len = max_seq_len or cfg.max_position_embeddings
    pairs, stats = load_preference_examples(data, load_tokenizer(model), seq_len)
    sums = [evaluate_pair(params, b) for b in pair_eval_batches(pairs, batch_size, seq_len)]
    totals = {k: sum(float(s[k]) for s in sums) for k in sums[0]}
    n = totals["pairs"]
    names = ({"accuracy": "accuracy", "margin": "margin"} if reward else
             {"accuracy": "rewards/accuracy", "margin": "rewards/margin"})
    return {"kind": "reward" if reward else "policy", "pairs": int(n), "loss": totals["loss"] / n,
            **{k: totals[v] / n for k, v in names.items()}, "dropped": stats.dropped_prompt_too_long}
