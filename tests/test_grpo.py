"""GRPO raises the mean reward of a verifiable task within minutes on CPU; bad reward paths are named."""

import jax
import numpy as np
import pytest
from steps import one_device_run

from jaxtune.config import TrainConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives.grpo import GRPOConfig, group_advantages, load_reward_function, rollout_batch, sample_group


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
