"""GRPO raises the mean reward of a verifiable task within minutes on CPU; bad reward paths are named; stop strings
cut completions alike in both rollout engines."""

from types import SimpleNamespace

import grpo_rewards
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import one_device_run

from jaxtune.config import DataConfig, ModelSection, OffloadConfig, TrainConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives.base import ObjectiveInputs
from jaxtune.objectives.grpo import GRPO, group_advantages, load_reward_function, rollout_batch, sample_group
from jaxtune.objectives.rollout_config import GRPOConfig


@pytest.mark.slow
def test_grpo_raises_mean_reward():
    tokenizer = Tokenizer.byte_level()
    reward = load_reward_function("grpo_rewards.count_letter_a")
    prompts_text = ["Write:", "Say:", "Go:", "Now:"]
    prompts = [tokenizer.encode(p) for p in prompts_text]
    cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,), max_position_embeddings=64)
    method = method_config("lora", rank=8, target_modules=("all-linear",))
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    grpo = GRPOConfig(group_size=8, max_new_tokens=8, temperature=1.0, kl_coef=0.0)
    tc = TrainConfig(learning_rate=2e-2, schedule="constant")
    run = one_device_run(cfg, method, "grpo", train=tc, total_steps=100, batch_size=4, seq_len=24, section=grpo)
    state = run.init_state(trainable, 0)
    means = []
    for it in range(25):
        rows, completions = sample_group(combine(state["params"], frozen), cfg, method, prompts, grpo, it, (2,))
        texts = [tokenizer.decode(c) for c in completions]
        rewards = reward([tokenizer.decode(r) for r in rows], texts)
        means.append(float(np.mean(rewards)))
        batch = rollout_batch(rows, completions, rewards, group_advantages(rewards, grpo), 24)
        state, metrics = run.step(state, frozen, None, {k: v[None] for k, v in batch.items()})
    assert np.mean(means[-5:]) > max(0.2, 3 * np.mean(means[:5])), means
    assert float(metrics["reward"]) == pytest.approx(means[-1], rel=1e-6)


@pytest.mark.parametrize("path, message", [("nowhere.module.fn", "cannot be imported"),
                                           ("grpo_rewards.missing", "cannot be imported"),
                                           ("justaname", "expected a dotted path")])
def test_reward_that_cannot_be_imported_is_named(path, message):
    with pytest.raises(JaxtuneError, match=f"reward '{path}'.*{message}"):
        load_reward_function(path)


def test_rollout_rows_are_laid_out_to_the_bucket_of_the_longest():
    """A batch of short rollouts under a long max_seq_len is [N, 32] (the bucket of its longest row, 19 positions),
    not [N, 1056]: the step's cost follows the tokens sampled (TRL pads to the longest too); nothing is cut."""
    prompts, completions = [[1, 5, 6], [1, 7]], [[9] * 17, [8, 2]]
    batch = rollout_batch(prompts, completions, [1.0, 0.0], np.asarray([0.5, -0.5]), 1056, eos_ids=(2,))
    assert {k: v.shape for k, v in batch.items()} == {**{k: (2, 32) for k in ("input_ids", "labels", "loss_mask",
                                                                                "segment_ids", "positions")},
                                                     "rewards": (2,), "advantages": (2,)}
    assert batch["labels"][0, :19].tolist() == [5, 6] + [9] * 17 and batch["segment_ids"][0].sum() == 19
    assert batch["loss_mask"].sum(1).tolist() == [0.0, 2.0]  # the first is truncated (no EOS); the second's 8, 2
    assert rollout_batch(prompts, completions, [1.0, 0.0], np.zeros(2), 24)["input_ids"].shape == (2, 24)  # the cap


@pytest.mark.slow
def test_stop_strings_cut_completions_alike_in_both_engines_and_train(tmp_path):
    """`[grpo] stop_strings` through `prepare` and a step, greedy (top_k 1): the padded and paged engines give the
    same rollout batch; a completion that reached the string ends with the token that completed it and keeps its
    loss under mask_truncated_completions (it ended); the reward sees its text cut before the string; the step on
    the batch (its advantages set apart: greedy groups are alike) has a finite loss and a gradient."""
    tokenizer = Tokenizer.byte_level()
    prompts = ["Write:", "Say:", "Go:", "Now:"]
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "{p}"}}\n' for p in prompts))
    cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,), max_position_embeddings=64)
    method = method_config("lora", rank=8, target_modules=("all-linear",))
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    keys = dict(reward="grpo_rewards.count_letter_a_seen", group_size=2, max_new_tokens=12, top_k=1,
                mask_truncated_completions=True, rollout_slots=3, rollout_page_size=4)
    _, full = sample_group(params, cfg, method, [tokenizer.encode(p) for p in prompts], GRPOConfig(**keys), 0, (2,))
    middle = [c for row in full for c in tokenizer.decode(row[2:9]) if c.isascii() and c.isprintable()]
    stop = max(set(middle), key=middle.count)  # a character greedy decoding reaches mid-way in some rows
    config = SimpleNamespace(model=ModelSection(), method=method, offload=OffloadConfig(),
                             data=DataConfig(train=str(tmp_path / "prompts.jsonl"), max_seq_len=24, eval_fraction=0.0),
                             train=TrainConfig(batch_size=4, grad_accum=1, seed=1))
    batches, seen = [], []
    for engine in ("padded", "paged"):
        section = GRPOConfig(**keys, stop_strings=(stop,), rollout_engine=engine)
        grpo_rewards.SEEN.clear()
        setup = ObjectiveInputs(config, section, cfg, tokenizer, lambda _: None, None)
        batches.append(GRPO.prepare(setup).batch(0, 0, lambda: params))
        seen.append(list(grpo_rewards.SEEN))
    assert seen[0] == seen[1] and batches[0].keys() == batches[1].keys()
    for k in batches[0]:
        np.testing.assert_array_equal(batches[0][k], batches[1][k], err_msg=k)
    batch = {k: v[0] for k, v in batches[0].items()}
    stopped = 0
    for labels, mask, text in zip(batch["labels"], batch["loss_mask"], seen[0]):
        assert stop not in text
        completion = labels[mask > 0].tolist()
        if completion and completion[-1] != 2:  # kept without EOS: it ended at the stop string
            assert stop in tokenizer.decode(completion) and stop not in tokenizer.decode(completion[:-1])
            assert text == tokenizer.decode(completion).split(stop)[0]
            stopped += 1
    assert stopped >= 2
    trainable, frozen = partition(params, trainable_mask(params, method))
    run = one_device_run(cfg, method, "grpo", total_steps=10, batch_size=4, seq_len=24, section=section)
    apart = {**batches[1], "advantages": np.resize(np.float32([1, -1]), batches[1]["advantages"].shape)}
    _, metrics = run.step(run.init_state(trainable, 0), frozen, None, {k: jnp.asarray(v) for k, v in apart.items()})
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
