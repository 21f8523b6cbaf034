"""Held-out loss and perplexity: the mean of -log p over every completion token of a file (sums, then one ratio)."""

from __future__ import annotations

from pathlib import Path

from jaxtune.data.batching import epoch_batches
from jaxtune.data.formats import load_sft_examples
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.llama import ForwardOptions
from jaxtune.train.metrics import perplexity
from jaxtune.train.step import make_eval_step


def evaluate(eval_step, params: dict, batches: list[dict]) -> tuple[float, float, int]:
    """(mean completion-token loss, perplexity, tokens) over all batches."""
    sums = [eval_step(params, batch) for batch in batches]
    total = sum(float(s) for s, _ in sums)
    count = int(sum(float(c) for _, c in sums))
    if count == 0:
        raise JaxtuneError("evaluation data has no completion tokens")
    return total / count, perplexity(total / count), count


def evaluate_file(model: str | Path, data: str | Path, adapter: str | Path | None = None,
                  max_seq_len: int | None = None, batch_size: int = 8,
                  options: ForwardOptions = ForwardOptions()) -> dict:
    """{"loss", "perplexity", "tokens", "examples", "dropped"} of a model (with an optional PEFT adapter) on a
    JSONL file.

    max_seq_len defaults to the model's context (max_position_embeddings); examples whose prompt does not fit are
    dropped and counted. Examples are packed, which leaves each example's logits unchanged.
    """
    from jaxtune.methods.peft import load_model_with_adapter

    cfg, params, method = load_model_with_adapter(model, adapter)
    tokenizer = load_tokenizer(model)
    seq_len = max_seq_len or cfg.max_position_embeddings
    examples, stats = load_sft_examples(data, tokenizer, seq_len)
    batches = epoch_batches(examples, batch_size, seq_len, seed=0, epoch=0, pack=True)
    loss, ppl, tokens = evaluate(make_eval_step(cfg, method, options), params, batches)
    return {"loss": loss, "perplexity": ppl, "tokens": tokens, "examples": len(examples),
            "dropped": stats.dropped_prompt_too_long + stats.dropped_empty}
