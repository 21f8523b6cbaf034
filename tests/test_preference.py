"""DPO/IPO training: batches, the reference without a copy, and a tiny run that learns held-out preferences."""

import json
import random

import jax
import numpy as np
import pytest
from steps import one_device_run

from jaxtune.config import TrainConfig, tiny_config
from jaxtune.data.formats import load_preference_examples
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives import objective_named
from jaxtune.objectives.base import strip_adapters
from jaxtune.objectives.dpo import PreferenceConfig, preference_batches

WORDS = ["apple", "river", "stone", "cloud", "green", "light", "music", "table", "paper", "tiger", "horse", "eagle"]


def write_pairs(path, n, seed):
    """Prompt: a word; chosen: the word in capitals; rejected: it reversed. A rule that generalises."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            w = rng.choice(WORDS) + rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"{w} ->", "chosen": " " + w.upper(), "rejected": " " + w[::-1]}) + "\n")


def test_batches_pair_chosen_and_rejected_rows(tmp_path):
    write_pairs(tmp_path / "p.jsonl", 5, 0)
    tokenizer = Tokenizer.byte_level()
    examples, _ = load_preference_examples(tmp_path / "p.jsonl", tokenizer, 64)
    batches = preference_batches(examples, 4, 64, seed=0, epoch=0)
    assert len(batches) == 2 and batches[0]["input_ids"].shape == (8, 64)
    first = batches[0]
    order = np.random.default_rng([0, 0]).permutation(5)
    pair = examples[order[0]]
    n = len(pair.prompt) + len(pair.chosen) - 1
    np.testing.assert_array_equal(first["input_ids"][0, :n], (pair.prompt + pair.chosen)[:-1])
    assert first["loss_mask"][0].sum() == len(pair.chosen)
    assert first["loss_mask"][4].sum() == len(pair.rejected)
    assert batches[1]["loss_mask"][1:4].sum() == 0  # empty pairs fill the last batch


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", pytest.param("ipo", marks=pytest.mark.full)])
def test_dpo_with_lora_raises_held_out_preference_accuracy(tmp_path, loss):
    write_pairs(tmp_path / "train.jsonl", 64, 0)
    write_pairs(tmp_path / "eval.jsonl", 32, 1)
    tokenizer = Tokenizer.byte_level()
    train, _ = load_preference_examples(tmp_path / "train.jsonl", tokenizer, 48)
    held_out, _ = load_preference_examples(tmp_path / "eval.jsonl", tokenizer, 48)
    cfg = tiny_config(vocab_size=259, initializer_range=0.1)
    method = method_config("lora", rank=8, target_modules=("all-linear",))
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    reference = strip_adapters(frozen)
    assert all(a is b for a, b in zip(jax.tree.leaves(reference["layers"]["q_proj"]),
                                      jax.tree.leaves(frozen["layers"]["q_proj"])))  # the same buffers, no copy
    tc = TrainConfig(learning_rate=5e-3, schedule="constant")
    preference = PreferenceConfig(loss=loss, beta=0.1 if loss == "sigmoid" else 0.5)
    run = one_device_run(cfg, method, "dpo", train=tc, total_steps=40, batch_size=16, seq_len=48, section=preference)
    assert run.second is None  # an adapter method's reference is its frozen base with adapters off

    def accuracy(state):
        from jaxtune.methods.transform import combine

        sums = [run.eval_step(combine(state["params"], frozen), None, b)
                for b in preference_batches(held_out, 16, 48, 0, 0)]
        return sum(float(s["rewards/accuracy"]) for s in sums) / sum(float(s["pairs"]) for s in sums)

    state = run.init_state(trainable, 0)
    before = accuracy(state)
    for epoch in range(10):
        for batch in preference_batches(train, 16, 48, 0, epoch):
            state, metrics = run.step(state, frozen, None, {k: v[None] for k, v in batch.items()})
    after = accuracy(state)
    assert before == 0.0  # at step 0 the policy is the reference: no pair is won yet
    assert after >= 0.9, (before, after)
    assert float(metrics["rewards/margin"]) > 0


@pytest.mark.slow
def test_reward_model_learns_held_out_pairwise_accuracy(tmp_path):
    from jaxtune.methods.transform import combine
    from jaxtune.models.reward_model import add_reward_head

    write_pairs(tmp_path / "train.jsonl", 64, 0)
    write_pairs(tmp_path / "eval.jsonl", 32, 1)
    tokenizer = Tokenizer.byte_level()
    train, _ = load_preference_examples(tmp_path / "train.jsonl", tokenizer, 48)
    held_out, _ = load_preference_examples(tmp_path / "eval.jsonl", tokenizer, 48)
    cfg = tiny_config(vocab_size=259, initializer_range=0.1)
    method = method_config("lora", rank=8, target_modules=("all-linear",))
    base = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    params = add_reward_head(apply_method(base, cfg, method, jax.random.key(1)), cfg, jax.random.key(2))
    trainable, frozen = partition(params, trainable_mask(params, method, objective_named("reward").head_leaves))
    assert trainable["score"]["kernel"].shape == (cfg.hidden_size,)
    tc = TrainConfig(learning_rate=5e-3, schedule="constant")
    run = one_device_run(cfg, method, "reward", train=tc, total_steps=40, batch_size=16, seq_len=48)

    def accuracy(state):
        sums = [run.eval_step(combine(state["params"], frozen), None, b)
                for b in preference_batches(held_out, 16, 48, 0, 0)]
        return sum(float(s["accuracy"]) for s in sums) / sum(float(s["pairs"]) for s in sums)

    state = run.init_state(trainable, 0)
    before = accuracy(state)
    for epoch in range(8):
        for batch in preference_batches(train, 16, 48, 0, epoch):
            state, metrics = run.step(state, frozen, None, {k: v[None] for k, v in batch.items()})
    assert accuracy(state) >= 0.9 > before
