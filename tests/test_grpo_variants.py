"""GRPO's loss variants (loss_type x importance_sampling_level x epsilon_high / delta / beta) and RLOO equal TRL 1.16's
own code: the step's loss and its gradient w.r.t. the per-token log-probs, summed over micro-batches as jaxtune's
`accumulate` sums them, against TRL's `_compute_loss` called once per accumulation step (an unbound method with a
SimpleNamespace for `self`); RLOO's advantages against TRL's `_generate_and_score_completions`. A short run of each
variant raises the held-out reward of test_grpo.py's task; bad values are one-line ConfigErrors."""

import itertools
import json
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import one_device_run

from jaxtune.config import TrainConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives.grpo import group_advantages, load_reward_function, rollout_batch, sample_group
from jaxtune.objectives.losses import grpo_token_loss, rloo_sequence_loss
from jaxtune.objectives.rloo import RLOO, RLOOConfig, reward_advantages, step_advantages
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.run_config import load_run_config
from jaxtune.spine.update import accumulate

A, B, T, L = 2, 4, 9, 9  # micro-batches, rows each, positions, TRL's max_completion_length
CASES = {  # (epsilon_high, delta, beta, off-policy old log-probs)
    "eps": (None, None, 0.04, True),
    "eps_high": (0.28, None, 0.04, True),
    "eps_high+delta, beta 0": (0.28, 1.5, 0.0, True),
    "on-policy": (0.28, None, 0.04, False),
}


def _rollouts(seed: int = 0) -> dict:
    """Per-token log-probs [A, B, T] of policy, old policy and reference, advantages [A, B], completion masks of
    different lengths (the micro-batches hold different token counts; one row has none)."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2.0, 0.5, (A, B, T))
    start, length = rng.integers(0, 3, (A, B)), rng.integers(1, T - 2, (A, B))
    length[1, 2] = 0
    positions = np.arange(T)
    mask = ((positions >= start[..., None]) & (positions < (start + length)[..., None])).astype(np.int64)
    return {"logp": logp, "old": logp + rng.normal(0, 0.3, logp.shape) + rng.normal(0, 0.2, (A, B, 1)),
            "ref": logp + rng.normal(0, 0.3, logp.shape), "adv": rng.normal(0, 1, (A, B)), "mask": mask}


def _jaxtune_step(micro_loss, r: dict, off_policy: bool):
    """(loss, d loss / d logp [A, B, T]) of one step over A micro-batches, as the spine computes them (float32)."""
    def loss_fn(trainable, micro):
        logp = trainable["logp"][micro["index"]]
        old = micro["old"] if off_policy else jax.lax.stop_gradient(logp)
        total, count = micro_loss(logp, old, micro)
        return total, (count, {})

    batch = {"index": jnp.arange(A), **{k: jnp.asarray(r[k], jnp.float32) for k in ("old", "ref", "adv", "mask")}}
    loss, _, grads, _ = jax.jit(lambda p, b: accumulate(loss_fn, p, b))({"logp": jnp.asarray(r["logp"],
                                                                                          jnp.float32)}, batch)
    return float(loss), np.asarray(grads["logp"])


def _trl_self(**fields) -> SimpleNamespace:
    """What TRL's `_compute_loss` reads of `self`: one process, training, no entropy / vLLM / aux-loss extras."""
    accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x)
    return SimpleNamespace(accelerator=accelerator, model=SimpleNamespace(training=True), use_vllm=False,
                           top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False,
                           _entropy_bonus_enabled=False, current_gradient_accumulation_steps=A,
                           _metrics={"train": defaultdict(list)}, **fields)


def _trl_step(compute_loss, trl_self, r: dict, off_policy: bool, extra_inputs):
    """TRL's loss of a step (its `_compute_loss` once per accumulation step, losses added as backward adds their
    gradients) and its gradient w.r.t. the per-token log-probs, in float64."""
    import torch

    logp = torch.tensor(r["logp"], dtype=torch.float64, requires_grad=True)
    total = 0.0
    for a in range(A):
        trl_self._get_per_token_logps_and_entropies = lambda *_, a=a, **__: (logp[a], torch.zeros(B, T), None)
        inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long),
                  "completion_mask": torch.tensor(r["mask"][a]), "advantages": torch.tensor(r["adv"][a]),
                  **extra_inputs(a, torch)}
        if off_policy:
            inputs["old_per_token_logps"] = torch.tensor(r["old"][a])
        total = total + compute_loss(trl_self, None, inputs)
    total.backward()
    return float(total.detach()), logp.grad.numpy()


def _assert_close(ours, theirs):
    (loss, grad), (trl_loss, trl_grad) = ours, theirs
    assert loss == pytest.approx(trl_loss, rel=1e-5)
    assert np.any(trl_grad != 0)
    np.testing.assert_allclose(grad, trl_grad, rtol=1e-5, atol=1e-5 * np.abs(trl_grad).max())


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("loss_type, level, case", list(itertools.product(("grpo", "dr_grpo", "dapo", "bnpo"),
                                                                          ("token", "sequence"), CASES)))
def test_grpo_loss_and_gradient_equal_trl(loss_type, level, case):
    from trl.trainer.grpo_trainer import GRPOTrainer

    epsilon_high, delta, beta, off_policy = CASES[case]
    r = _rollouts()
    g = GRPOConfig(clip=0.2, epsilon_high=epsilon_high or 0.0, delta=delta or 0.0, kl_coef=beta, loss_type=loss_type,
                   importance_sampling_level=level, max_new_tokens=L)

    def micro_loss(logp, old, micro):
        return grpo_token_loss(logp, old, micro["ref"], micro["adv"], micro["mask"], g.clip, g.kl_coef,
                               clip_high=g.clip_high, delta=g.delta or None, level=level, loss_type=loss_type,
                               max_completion_length=g.max_new_tokens)

    args = SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=A)
    trl_self = _trl_self(args=args, loss_type=loss_type, importance_sampling_level=level, beta=beta,
                         epsilon_low=0.2, epsilon_high=epsilon_high or 0.2, max_completion_length=L)
    extra = lambda a, torch: {"ref_per_token_logps": torch.tensor(r["ref"][a]),
                              "num_items_in_batch": torch.tensor(r["mask"].sum())}
    _assert_close(_jaxtune_step(micro_loss, r, off_policy),
                  _trl_step(GRPOTrainer._compute_loss, trl_self, r, off_policy, extra))


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_rloo_loss_and_gradient_equal_trl(case):
    from trl.trainer.rloo_trainer import RLOOTrainer

    epsilon_high, _, _, off_policy = CASES[case]
    r = _rollouts(1)
    r["old"] = r["logp"] + np.random.default_rng(2).normal(0, 0.05, r["logp"].shape)  # sequence ratios near 1
    rloo = RLOOConfig(clip=0.2, epsilon_high=epsilon_high or 0.0)
    micro_loss = lambda logp, old, micro: rloo_sequence_loss(logp, old, micro["adv"], micro["mask"], rloo.clip,
                                                             rloo.clip_high)
    trl_self = _trl_self(epsilon_low=0.2, epsilon_high=epsilon_high or 0.2)
    compute_loss = lambda s, model, inputs: RLOOTrainer._compute_loss(s, model, inputs) / A  # Trainer divides by GA
    old = r["old"] if off_policy else r["logp"]
    extra = lambda a, torch: {"old_logps": torch.tensor((old[a] * r["mask"][a]).sum(-1))}
    _assert_close(_jaxtune_step(micro_loss, r, off_policy), _trl_step(compute_loss, trl_self, r, False, extra))


P, G, C = 3, 4, 6  # prompts, completions of each, completion positions


def _scored_rollouts(seed: int = 3) -> dict:
    """Completions of different lengths [P * G], their rewards, and per-token log-probs of policy and reference."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, C + 1, P * G)
    return {"lengths": lengths, "mask": (np.arange(C)[None] < lengths[:, None]).astype(np.float64),
            "logp": rng.normal(-2, 0.5, (P * G, C)), "ref": rng.normal(-2, 0.5, (P * G, C)),
            "rewards": rng.random(P * G)}


def _trl_scored(trainer, generated, r: dict, **fields) -> dict:
    """TRL's `trainer._generate_and_score_completions` on rollouts `r`: its generation (`generated(prompts)`), reward
    functions and log-probs handed in through a SimpleNamespace `self`, one process, training."""
    import torch

    policy = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": defaultdict(list)}
    rewards = torch.tensor(r["rewards"]).reshape(P * G, -1)  # [N, K]: a column a reward function
    K = rewards.shape[1]
    fields = {"mask_truncated_completions": False, "reward_weights": torch.ones(K), "reward_funcs": [None] * K,
              "reward_func_names": [f"r{k}" for k in range(K)], "_metrics": {"train": defaultdict(list)}, **fields}
    trl_self = SimpleNamespace(
        accelerator=SimpleNamespace(device="cpu", process_index=0, num_processes=1, gather=lambda x: x,
                                    reduce=lambda x, reduction: x),
        model=policy, ref_model=object(), num_generations=G,
        _generate=generated, _calculate_rewards=lambda *_: rewards,
        _get_per_token_logps_and_entropies=lambda model, *_, **__: (torch.tensor(r["logp" if model is policy
                                                                                   else "ref"]), None, None),
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        args=SimpleNamespace(per_device_train_batch_size=P * G, gradient_checkpointing_kwargs=None,
                             steps_per_generation=1, gradient_accumulation_steps=1),
        _logs=logs, _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False, **fields)
    return trainer._generate_and_score_completions(trl_self, [{"prompt": "p"} for _ in range(P * G)])


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_equal_trl(scale):
    """`scale_rewards`: the group's mean subtracted, divided by the group's std, the batch's, or nothing: jaxtune's
    `group_advantages` against TRL's `GRPOTrainer._generate_and_score_completions` on the same rewards."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    r = _scored_rollouts()
    completions = [[5] * int(n) for n in r["lengths"]]
    generated = lambda prompts: ([[1, 2]] * len(prompts), completions, None, ["c"] * len(prompts), None, {}, None,
                                 None)
    out = _trl_scored(GRPOTrainer, generated, r, beta=0.0, scale_rewards=scale, num_iterations=1, use_vllm=False,
                      multi_objective_aggregation="sum_then_normalize", environment_factories=None,
                      environments=None, tools=None, _is_vlm=False)
    ours = group_advantages(r["rewards"].tolist(), GRPOConfig(group_size=G, scale_rewards=scale))
    np.testing.assert_allclose(ours, out["advantages"].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("beta, clip_range, normalize", [(0.05, (), False), (0.0, (0.2, 0.8), False),
                                                         (0.1, (0.1, 0.9), True)])
def test_rloo_advantages_equal_trl(beta, clip_range, normalize):
    """Rewards clipped, less beta times each row's sequence KL sum(log pi - log ref), leave-one-out within groups,
    optionally normalised over the batch: jaxtune's two halves (`reward_advantages` with the rollout,
    `step_advantages` in the step) against TRL's `RLOOTrainer._generate_and_score_completions` on the same rollouts."""
    from trl.trainer.rloo_trainer import RLOOTrainer

    r = _scored_rollouts()
    completions = [[5] * int(n) for n in r["lengths"]]
    generated = lambda prompts: ([[1, 2]] * len(prompts), completions, ["c"] * len(prompts))
    out = _trl_scored(RLOOTrainer, generated, r, beta=beta, reward_clip_range=clip_range or None,
                      normalize_advantages=normalize)

    rloo = RLOOConfig(group_size=G, kl_coef=beta, reward_clip_range=clip_range, normalize_advantages=normalize)
    kl = jnp.asarray(((r["logp"] - r["ref"]) * r["mask"]).sum(-1), jnp.float32)  # the step reads it from its logps
    ours = step_advantages(jnp.asarray(reward_advantages(r["rewards"].tolist(), rloo)), kl, rloo)
    np.testing.assert_allclose(ours, out["advantages"].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((r["logp"] * r["mask"]).sum(-1), out["old_logps"].numpy(), rtol=1e-12)


@pytest.mark.parametrize("section, key, value, message", [
    (GRPOConfig, "loss_type", "ppo", "choose one of dapo, grpo, dr_grpo, bnpo"),
    (GRPOConfig, "importance_sampling_level", "row", "choose one of token, sequence"),
    (GRPOConfig, "scale_rewards", "std", "choose one of group, batch, none"),
    (GRPOConfig, "epsilon_high", 0.1, "must be >= clip = 0.2"),
    (GRPOConfig, "delta", 0.9, "must be > 1"),
    (GRPOConfig, "num_iterations", 0, "must be >= 1"),
    (GRPOConfig, "soft_punish_cache", 33, r"must be in \[0, 32\]"),
    (GRPOConfig, "sampler_importance_sampling_mode", "token", "choose one of token_truncate, token_mask, "
                                                            "sequence_truncate, sequence_mask"),
    (GRPOConfig, "sampler_importance_sampling_clip_min", 4.0, "must be < sampler_importance_sampling_clip_max = 3.0"),
    (GRPOConfig, "top_entropy_quantile", 1.5, r"must be in \[0, 1\]"),
    (GRPOConfig, "entropy_coef", -0.1, "must be >= 0"),
    (GRPOConfig, "stop_strings", ("\n", ""), "must be a list of non-empty strings"),
    (RLOOConfig, "stop_strings", ("a", 3), "must be a list of non-empty strings"),
    (RLOOConfig, "epsilon_high", -1.0, "must be >= clip = 0.2"),
    (RLOOConfig, "num_iterations", 0, "must be >= 1"),
    (RLOOConfig, "reward_clip_range", (1.0, 0.0), r"must be \[min, max\] with min <= max"),
    (RLOOConfig, "reward_clip_range", (1.0,), r"must be \[min, max\]")])
def test_bad_values_are_one_line_config_errors(section, key, value, message):
    with pytest.raises(ConfigError, match=f"^{key} = .*: {message}") as error:
        section(**{key: value})
    assert "\n" not in str(error.value)
    name = "grpo" if section is GRPOConfig else "rloo"
    with pytest.raises(JaxtuneError, match=f"{name}.{key}.*{message}"):
        load_run_config(None, [f"{name}.{key}={json.dumps(list(value) if isinstance(value, tuple) else value)}"])


@pytest.mark.parametrize("keys, key, message", [
    ({"loss_type": "cispo"}, "epsilon_high", "must be set with loss_type = \"cispo\""),
    ({"sampler_importance_sampling_mode": "token_truncate", "sampler_importance_sampling_clip_max": 0.0},
     "sampler_importance_sampling_clip_max", "must be > 0 with a \\*_truncate mode"),
    ({"environment": "tools", "stop_strings": ("\n",)}, "stop_strings",
     "ends completions jaxtune samples, not an environment's")])
def test_bad_combinations_are_one_line_config_errors(keys, key, message):
    with pytest.raises(ConfigError, match=f"^{key} = .*: {message}") as error:
        GRPOConfig(**keys)
    assert "\n" not in str(error.value)


def test_rloo_normalising_over_several_micro_batches_is_refused():
    setup = SimpleNamespace(section=RLOOConfig(normalize_advantages=True),
                            config=SimpleNamespace(train=SimpleNamespace(grad_accum=2)))
    with pytest.raises(JaxtuneError, match=r"^\[rloo\] normalize_advantages = true with \[train\] grad_accum = 2"):
        RLOO.prepare(setup)


def _sampled_reward(params, cfg, method, prompts, tokenizer, reward, section) -> float:
    """The mean reward of `group_size` completions sampled for each of `prompts` (a fixed seed)."""
    _, completions = sample_group(params, cfg, method, prompts, section, 999, (2,))
    return float(np.mean(reward(None, [tokenizer.decode(c) for c in completions])))


@pytest.mark.slow
@pytest.mark.parametrize("objective, variant", [
    pytest.param("grpo", {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
                 marks=pytest.mark.full),
    pytest.param("grpo", {"loss_type": "dr_grpo", "scale_rewards": "none"}, marks=pytest.mark.full),  # Dr. GRPO
    pytest.param("grpo", {"loss_type": "bnpo", "epsilon_high": 0.28, "scale_rewards": "batch"}, marks=pytest.mark.full),
    ("rloo", {"normalize_advantages": True})])
def test_each_variant_raises_the_held_out_reward(objective, variant):
    """test_grpo.py's task (reward: the share of 'a' in the completion; no KL penalty, as there) for 20 steps: the
    completions sampled for prompts never trained on score higher than before."""
    tokenizer = Tokenizer.byte_level()
    reward = load_reward_function("grpo_rewards.count_letter_a")
    prompts = [tokenizer.encode(p) for p in ["Write:", "Say:", "Go:", "Now:"]]
    held_out = [tokenizer.encode(p) for p in ["Tell:", "Do:", "Sing:"]]
    cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,), max_position_embeddings=64)
    method = method_config("lora", rank=8, target_modules=("all-linear",))
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    section = (GRPOConfig if objective == "grpo" else RLOOConfig)(group_size=8, max_new_tokens=8, kl_coef=0.0,
                                                                  **variant)
    advantages = group_advantages if objective == "grpo" else reward_advantages
    run = one_device_run(cfg, method, objective, train=TrainConfig(learning_rate=2e-2, schedule="constant"),
                         total_steps=100, batch_size=4, seq_len=24, section=section)
    state = run.init_state(trainable, 0)
    before = _sampled_reward(params, cfg, method, held_out, tokenizer, reward, section)
    for it in range(20):
        rows, completions = sample_group(combine(state["params"], frozen), cfg, method, prompts, section, it, (2,))
        rewards = reward([tokenizer.decode(r) for r in rows], [tokenizer.decode(c) for c in completions])
        batch = rollout_batch(rows, completions, rewards, advantages(rewards, section), 24)
        state, metrics = run.step(state, frozen, None, {k: v[None] for k, v in batch.items()})
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["kl"]))
    after = _sampled_reward(combine(state["params"], frozen), cfg, method, held_out, tokenizer, reward, section)
    assert before < 0.05 and after > 0.6, (before, after)
