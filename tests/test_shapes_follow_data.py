"""Shapes follow the data (issue 13): on a model whose config says 8,192 positions, `evaluate_file`,
`evaluate_preference_file` and `generate` pad short rows to the power-of-two bucket of the longest one, never to the
context, and give what explicit small shapes give."""

import json

import jax
import numpy as np
import pytest
from conftest import numpy_random_params

from jaxtune.config import ForwardOptions, SamplingConfig, tiny_config
from jaxtune.data.batching import BATCH_FIELDS, MIN_BUCKET, bucket, epoch_batches, eval_batches
from jaxtune.data.formats import Example, load_preference_examples, load_sft_examples
from jaxtune.data.tokenizer import Tokenizer, copy_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params
from jaxtune.models.reward_model import add_reward_head, save_reward_model
from jaxtune.objectives import reward
from jaxtune.objectives.base import Context
from jaxtune.objectives.dpo import preference_batches
from jaxtune.presets import tiny_model_config, write_random_model
from jaxtune.spine.model import load_reward_model
from jaxtune.train import evaluation

CONTEXT = 8192
SMALL = 100  # an explicit max_seq_len that holds every row below, as a user would pass before this change
BATCH = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random model and a reward model with 8,192-position configs, 20 short SFT rows and 12 short pairs."""
    root = tmp_path_factory.mktemp("shapes")
    model = write_random_model(root / "model", "llama", seed=0, max_position_embeddings=CONTEXT,
                               initializer_range=0.1)
    cfg = tiny_model_config("llama", max_position_embeddings=CONTEXT, initializer_range=0.1)
    params = add_reward_head(init_params(cfg, jax.random.key(1)), cfg, jax.random.key(2))
    reward_model = save_reward_model(root / "reward", cfg, params)
    copy_tokenizer(model, reward_model)
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"q{i}:" + "?" * (i % 4), "completion": " ab" * (1 + i % 6)}) + "\n"
                           for i in range(20)))
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"w{i} ->", "chosen": " up" * (1 + i % 3),
                                         "rejected": " down" * (1 + i % 5)}) + "\n" for i in range(12)))
    return model, reward_model, sft, pairs


def record(monkeypatch, module, name):
    """Calls of module.name, as (args, kwargs), passed through to the original."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def longest_positions(examples):
    return max(len(ex.ids) - 1 for ex in examples)


def test_sft_eval_pads_to_the_longest_row_bucket_and_scores_as_a_small_max_seq_len(files, monkeypatch):
    model, _, sft, _ = files
    calls = record(monkeypatch, evaluation, "evaluate")
    result = evaluation.evaluate_file(model, sft, batch_size=BATCH)
    (step, params, batches), _ = calls[0]

    examples, _ = load_sft_examples(sft, Tokenizer.byte_level(), CONTEXT)
    longest = longest_positions(examples)
    assert 16 < longest <= 32, longest  # the rows' bucket is 32
    lengths = [batch["input_ids"].shape[1] for batch in batches]
    assert max(lengths) == bucket(longest) == 32 and set(lengths) <= {16, 32}, lengths
    assert all(a.shape[0] == BATCH for batch in batches for a in batch.values())
    assert lengths == sorted(lengths, reverse=True)  # fullest rows first: one compile per bucket, in a row

    # The same sums as before: packed rows of an explicit max_seq_len, in the old (shuffled) order and shape.
    old = evaluation.evaluate(step, params, epoch_batches(examples, BATCH, SMALL, seed=0, epoch=0, pack=True))
    np.testing.assert_allclose(result["loss"], old[0], rtol=1e-6)
    assert result["tokens"] == old[2] and result["examples"] == 20 and result["dropped"] == 0
    # With the cap passed explicitly the shapes, and so the numbers, are the same.
    assert evaluation.evaluate_file(model, sft, max_seq_len=SMALL, batch_size=BATCH) == result


@pytest.mark.full
def test_sft_eval_memory_is_set_by_the_rows_not_the_context(files, monkeypatch):
    """The compiled step at the shapes run needs a small fraction of the temporary memory of one at the context."""
    model, _, sft, _ = files
    calls = record(monkeypatch, evaluation, "evaluate")
    evaluation.evaluate_file(model, sft, batch_size=BATCH)
    (step, params, batches), _ = calls[0]

    def temp_bytes(T):
        batch = {k: jax.ShapeDtypeStruct((BATCH, T), dtype) for k, dtype in BATCH_FIELDS.items()}
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    run = temp_bytes(batches[0]["input_ids"].shape[1])
    at_context = temp_bytes(CONTEXT)
    assert 0 < run * 64 < at_context, (run, at_context)  # the context is 256 times the rows' bucket


@pytest.mark.full
def test_preference_eval_pads_to_the_longest_pair_bucket_and_scores_as_before(files, monkeypatch):
    model, reward_model, _, pairs_file = files
    calls = record(monkeypatch, evaluation, "pair_eval_batches")
    result = evaluation.evaluate_preference_file(reward_model, pairs_file, batch_size=BATCH)
    (pairs, batch_size, seq_len), _ = calls[0]
    assert (batch_size, seq_len) == (BATCH, CONTEXT)
    longest = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) - 1 for p in pairs)
    lengths = [b["input_ids"].shape[1] for b in evaluation.pair_eval_batches(pairs, BATCH, CONTEXT)]
    assert max(lengths) == bucket(longest, MIN_BUCKET) < 64 and lengths == sorted(lengths, reverse=True), lengths

    # Before: pairs in a seeded order, every row padded to max_seq_len.
    cfg, params = load_reward_model(reward_model)
    terms = jax.jit(lambda params, batch: reward.eval_terms(Context(cfg, None, ForwardOptions()))(params, None, batch))
    examples, _ = load_preference_examples(pairs_file, Tokenizer.byte_level(), SMALL)
    sums = [terms(params, b) for b in preference_batches(examples, BATCH, SMALL, seed=0, epoch=0)]
    totals = {k: sum(float(s[k]) for s in sums) for k in sums[0]}
    assert result["pairs"] == totals["pairs"] == 12
    for key in ("loss", "accuracy", "margin"):
        np.testing.assert_allclose(result[key], totals[key] / 12, rtol=1e-5, atol=1e-7, err_msg=key)


def test_eval_batches_cap_at_max_seq_len():
    """A cap below the bucket (not a power of two) is the length: 40 positions pad to 40, not 64."""
    examples = [Example(list(range(1, n + 1)), [0] + [1] * (n - 1)) for n in (41, 30, 5, 3)]
    (batch,) = eval_batches(examples, 2, 40)
    assert batch["input_ids"].shape == (2, 40)  # 40 positions alone, 29 + 4 + 2 packed in the second row
    assert batch["loss_mask"].sum() == sum(n - 1 for n in (41, 30, 5, 3))


# Generation ------------------------------------------------------------------------------------------------------

GEN_CFG = tiny_config(vocab_size=259, num_layers=2, max_position_embeddings=CONTEXT)
NEW = 12


@pytest.fixture(scope="module")
def gen_params():
    return numpy_random_params(GEN_CFG)


def greedy_without_cache(params, cfg, prompt, steps):
    """Greedy tokens from the full forward, no cache and no padding (right-padded to one shape: causal)."""
    width = len(prompt) + steps
    run = jax.jit(lambda params, ids: forward(params, ids, cfg))
    tokens = list(prompt)
    for _ in range(steps):
        ids = np.zeros((1, width), np.int32)
        ids[0, :len(tokens)] = tokens
        tokens.append(int(np.argmax(np.asarray(run(params, ids))[0, len(tokens) - 1])))
    return tokens[len(prompt):]


@pytest.mark.full
def test_generation_cache_is_the_prompt_bucket_plus_new_tokens(gen_params, monkeypatch):
    from jaxtune import generation

    calls = record(monkeypatch, generation, "begin")
    prompts = [[5, 17, 3, 99, 42], [7, 8, 9]]
    out = generation.generate(gen_params, GEN_CFG, prompts, SamplingConfig(max_new_tokens=NEW), eos_ids=())
    (_, packed, *_), kwargs = calls[0]
    assert packed.source_BxW.shape == (2, MIN_BUCKET) and kwargs["cache_size"] == MIN_BUCKET + NEW
    assert out == [greedy_without_cache(gen_params, GEN_CFG, p, NEW) for p in prompts]


@pytest.mark.full
def test_generation_bucket_is_cut_back_to_the_context(gen_params, monkeypatch):
    """A 40-token prompt's bucket (64) + 12 new tokens would pass a 64-position context: the cache is the context."""
    from jaxtune import generation

    cfg = GEN_CFG.replace(max_position_embeddings=64)
    calls = record(monkeypatch, generation, "begin")
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, 40).tolist()
    out = generation.generate(gen_params, cfg, [prompt], SamplingConfig(max_new_tokens=NEW), eos_ids=())
    (_, packed, *_), kwargs = calls[0]
    assert packed.source_BxW.shape == (1, 64 - NEW) and kwargs["cache_size"] == 64
    assert out == [greedy_without_cache(gen_params, cfg, prompt, NEW)]
    with pytest.raises(JaxtuneError, match="prompt 0 has 60 tokens: with max_new_tokens=12 it would pass the "
                                           "model's context of 64"):
        generation.generate(gen_params, cfg, [prompt + prompt[:20]], SamplingConfig(max_new_tokens=NEW))
