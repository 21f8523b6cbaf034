"""Off-policy GRPO and RLOO (issue 51): CISPO, the sampler's importance weights, top-entropy tokens and the entropy
bonus equal TRL 1.16's `_compute_loss` (loss and gradient w.r.t. the per-token log-probs and entropies, summed over
micro-batches as `accumulate` sums them); the weights, overlong filtering and the soft overlong punishment equal
TRL's `_generate_and_score_completions` and `get_soft_overlong_punishment`; `num_iterations` reuses one rollout
batch, also across a resume; a short run with num_iterations = 2 raises the held-out reward."""

from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import one_device_run
from test_grpo_variants import A, B, L, T, _assert_close, _rollouts, _scored_rollouts, _trl_scored, _trl_self

from jaxtune.config import DataConfig, ModelSection, OffloadConfig, TrainConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives.base import ObjectiveInputs
from jaxtune.objectives.grpo import GRPO, rollout_batch, soft_overlong_punishment
from jaxtune.objectives.losses import grpo_token_loss, sampler_weights
from jaxtune.objectives.rloo import RLOO, RLOOConfig
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.spine.update import accumulate

CASES = {  # GRPOConfig keys beyond loss_type; "is": (mode, C_min, C_max) of the sampler's weights
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "cispo sequence, token_truncate": {"loss_type": "cispo", "epsilon_high": 1.1, "importance_sampling_level":
                                       "sequence", "is": ("token_truncate", 0.0, 1.1)},
    "cispo, bonus, top entropy": {"loss_type": "cispo", "epsilon_high": 5.0, "entropy_coef": 0.05,
                                  "top_entropy_quantile": 0.2},
    "dapo, bonus, top entropy, token_mask": {"entropy_coef": 0.05, "top_entropy_quantile": 0.3,
                                             "is": ("token_mask", 0.9, 1.1)},
    "grpo, bonus, sequence_mask": {"loss_type": "grpo", "entropy_coef": 0.1, "is": ("sequence_mask", 0.9, 1.05)},
    "bnpo, top entropy, sequence_truncate": {"loss_type": "bnpo", "top_entropy_quantile": 0.5,
                                             "is": ("sequence_truncate", 0.9, 1.2)},
    "dr_grpo, bonus": {"loss_type": "dr_grpo", "entropy_coef": 0.02, "epsilon_high": 0.28},
}


def _section(case: dict) -> GRPOConfig:
    keys = {k: v for k, v in case.items() if k != "is"}
    mode, low, high = case.get("is", ("sequence_mask", 0.0, 3.0))
    return GRPOConfig(clip=0.2, kl_coef=0.04, max_new_tokens=L, sampler_importance_sampling_correction="is" in case,
                      sampler_importance_sampling_mode=mode, sampler_importance_sampling_clip_min=low,
                      sampler_importance_sampling_clip_max=high, **keys)


def _ours(g: GRPOConfig, r: dict):
    """(loss, d loss / d logp, d loss / d entropy) of one step over A micro-batches, as the spine computes them."""
    def loss_fn(trainable, micro):
        logp, entropy = trainable["logp"][micro["index"]], trainable["entropy"][micro["index"]]
        weights = (sampler_weights(micro["old"], micro["sampler"], micro["mask"], g.sampler_importance_sampling_mode,
                                   *g.sampler_clip) if g.sampler_importance_sampling_correction else None)
        total, count = grpo_token_loss(logp, micro["old"], micro["ref"], micro["adv"], micro["mask"], g.clip,
                                       g.kl_coef, clip_high=g.clip_high, level=g.importance_sampling_level,
                                       loss_type=g.loss_type, max_completion_length=g.max_new_tokens, weights=weights,
                                       entropy_BxT=entropy, top_entropy_quantile=g.top_entropy_quantile,
                                       entropy_coef=g.entropy_coef, tokens_per_micro=micro["tokens"])
        return total, (count, {})

    batch = {"index": jnp.arange(A), "tokens": jnp.full((A, B), r["mask"].sum() / A, jnp.float32),
             **{k: jnp.asarray(r[k], jnp.float32) for k in ("old", "ref", "adv", "mask", "sampler")}}
    trainable = {k: jnp.asarray(r[k], jnp.float32) for k in ("logp", "entropy")}
    loss, _, grads, _ = jax.jit(lambda p, b: accumulate(loss_fn, p, b))(trainable, batch)
    return float(loss), np.asarray(grads["logp"]), np.asarray(grads["entropy"])


def _trl(g: GRPOConfig, r: dict):
    """TRL's loss of the step (`_compute_loss` once per accumulation step) and its gradients, in float64; its
    `importance_sampling_ratio` input is `sampler_weights` (test_sampler_weights_equal_trl compares those)."""
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    corrected = g.sampler_importance_sampling_correction
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=A)
    trl_self = _trl_self(args=args, loss_type=g.loss_type, importance_sampling_level=g.importance_sampling_level,
                         beta=g.kl_coef, epsilon_low=g.clip, epsilon_high=g.clip_high, max_completion_length=L)
    trl_self.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    trl_self.accelerator.sync_gradients = True
    trl_self.use_vllm = trl_self.vllm_importance_sampling_correction = corrected
    trl_self.top_entropy_quantile, trl_self.entropy_coef = g.top_entropy_quantile, g.entropy_coef
    trl_self._entropy_bonus_enabled, trl_self.use_adaptive_entropy = bool(g.entropy_coef), False
    trl_self.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trl_self, *a)
    logp = torch.tensor(r["logp"], dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor(r["entropy"], dtype=torch.float64, requires_grad=True)
    total = 0.0
    for a in range(A):
        trl_self._get_per_token_logps_and_entropies = lambda *_, a=a, **__: (logp[a], entropy[a], None)
        inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": torch.tensor(r["mask"][a]),
                  "advantages": torch.tensor(r["adv"][a]), "old_per_token_logps": torch.tensor(r["old"][a]),
                  "ref_per_token_logps": torch.tensor(r["ref"][a]), "num_items_in_batch": torch.tensor(r["mask"].sum())}
        if corrected:
            weights = sampler_weights(jnp.asarray(r["old"][a]), jnp.asarray(r["sampler"][a]), jnp.asarray(r["mask"][a]),
                                      g.sampler_importance_sampling_mode, *g.sampler_clip)
            inputs["importance_sampling_ratio"] = torch.tensor(np.asarray(weights, np.float64))
        total = total + GRPOTrainer._compute_loss(trl_self, None, inputs)
    total.backward()
    no_grad = np.zeros_like(r["entropy"])  # no entropy bonus: the entropies get no gradient
    return (float(total.detach()), logp.grad.numpy(),
            no_grad if entropy.grad is None else entropy.grad.numpy())


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_cispo_sampler_weights_and_entropy_equal_trl(case):
    g = _section(CASES[case])
    r = _rollouts(4)
    rng = np.random.default_rng(5)
    r["entropy"] = rng.uniform(0.05, 3.0, r["logp"].shape)
    r["sampler"] = r["old"] + rng.normal(0, 0.08, r["old"].shape)
    (loss, grad, grad_entropy), (trl_loss, trl_grad, trl_grad_entropy) = _ours(g, r), _trl(g, r)
    _assert_close((loss, grad), (trl_loss, trl_grad))
    if g.entropy_coef:
        np.testing.assert_allclose(grad_entropy, trl_grad_entropy, rtol=1e-5, atol=1e-7)
    else:
        assert not np.any(grad_entropy) and not np.any(trl_grad_entropy)


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("mode, low, high", [("token_truncate", 0.0, 1.1), ("token_mask", 0.9, 1.1),
                                             ("sequence_truncate", 0.9, 0.0), ("sequence_mask", 0.8, 1.25)])
def test_sampler_weights_and_truncated_completions_equal_trl(mode, low, high):
    """The sampler's importance weights of the learner's log-probs at sampling time over the sampler's (one token
    unreported: NaN), and overlong filtering (the loss mask of a completion that does not end with EOS), against TRL's
    `_generate_and_score_completions` with use_vllm and mask_truncated_completions."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    r = _scored_rollouts()
    n = len(r["lengths"])
    completions = [[5] * (int(k) - 1) + [2 if i % 3 else 7] for i, k in enumerate(r["lengths"])]  # 2: EOS
    rng = np.random.default_rng(6)
    sampled = [list(r["logp"][i, :len(c)] + rng.normal(0, 0.08, len(c))) for i, c in enumerate(completions)]
    sampled[1][0] = float("nan")
    generated = lambda prompts: ([[1, 2]] * len(prompts), completions, None, ["c"] * len(prompts), sampled, {}, None,
                                 None)
    out = _trl_scored(GRPOTrainer, generated, r, beta=0.0, scale_rewards="group", num_iterations=1, use_vllm=True,
                      multi_objective_aggregation="sum_then_normalize", environment_factories=None,
                      environments=None, tools=None, _is_vlm=False, vllm_importance_sampling_correction=True,
                      vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=low or None,
                      vllm_importance_sampling_clip_max=high or None, mask_truncated_completions=True,
                      eos_token_ids=[2])
    g = GRPOConfig(sampler_importance_sampling_mode=mode, sampler_importance_sampling_clip_min=low,
                   sampler_importance_sampling_clip_max=high)
    batch = rollout_batch([[1]] * n, completions, [0.0] * n, np.zeros(n), 1 + r["mask"].shape[1], eos_ids=(2,),
                          sampler_logps=sampled)
    mask = batch["loss_mask"][:, :-1]  # position 0 predicts the first completion token
    np.testing.assert_array_equal(mask, out["completion_mask"].numpy())
    weights = sampler_weights(jnp.asarray(r["logp"]), jnp.asarray(batch["sampler_logps"][:, :-1]), jnp.asarray(mask),
                              g.sampler_importance_sampling_mode, *g.sampler_clip)
    expected = out["importance_sampling_ratio"].numpy()
    assert np.isfinite(expected).all() and (0 < expected.size)
    np.testing.assert_allclose(np.broadcast_to(weights, expected.shape), expected, rtol=1e-5, atol=1e-6)


def test_soft_overlong_punishment_equals_trl():
    from trl.rewards import get_soft_overlong_punishment

    lengths = list(range(0, 14))
    trl = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)([[1] * n for n in lengths])
    np.testing.assert_allclose(soft_overlong_punishment(lengths, 10, 4), trl, rtol=1e-12)


PROMPTS, HELD_OUT = ["Write:", "Say:", "Go:", "Now:"], ["Tell:", "Do:", "Sing:"]


def _setup(tmp_path: Path, section, cache: bool = True, checkpoint_every: int = 0):
    """What `prepare` reads of a run: test_grpo.py's task (reward: the share of 'a'), four training prompts a step
    (sampling seed 1: the first rollouts have some 'a', so the first steps have an advantage to follow)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{p}"}}\n' for p in PROMPTS))
    (tmp_path / "eval.jsonl").write_text("".join(f'{{"prompt": "{p}"}}\n' for p in HELD_OUT))
    config = SimpleNamespace(model=ModelSection(), method=method_config("lora", rank=8, target_modules=("all-linear",)),
                             data=DataConfig(train=str(data), eval=str(tmp_path / "eval.jsonl"), max_seq_len=24),
                             train=TrainConfig(batch_size=4, grad_accum=1, checkpoint_every=checkpoint_every, seed=1),
                             offload=OffloadConfig())
    cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,), max_position_embeddings=64)
    return ObjectiveInputs(config, section, cfg, Tokenizer.byte_level(), lambda _: None,
                           tmp_path / "cache" if cache else None)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", pytest.param("rloo", marks=pytest.mark.full)])
def test_num_iterations_2_reuses_rollouts_resumes_and_raises_the_held_out_reward(tmp_path, objective):
    """num_iterations = 2 through the objective's own `prepare` and the spine's step, 10 rollout batches of 2 steps:
    both steps of a batch take the same rollouts, whose `old_logps` are the learner's at sampling time (the first
    step's ratio is 1); a fresh process (a resumed run) given the second step reads them back from the run's
    directory although the policy has moved; the held-out reward rises."""
    from test_grpo_variants import _sampled_reward

    from jaxtune.objectives.grpo import load_reward_function, policy_and_reference_logps

    section = (GRPOConfig if objective == "grpo" else RLOOConfig)(
        reward="grpo_rewards.count_letter_a", group_size=8, max_new_tokens=8, kl_coef=0.0, num_iterations=2)
    setup = _setup(tmp_path, section)
    cfg, method = setup.cfg, setup.config.method
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    run = one_device_run(cfg, method, objective, train=TrainConfig(learning_rate=2e-2, schedule="constant"),
                         total_steps=100, batch_size=4, seq_len=24, section=section)
    data = (GRPO if objective == "grpo" else RLOO).prepare(setup)
    assert data.steps_per_epoch == 2
    state = run.init_state(trainable, 0)
    tokenizer, reward = setup.tokenizer, load_reward_function(section.reward[0])
    held_out = [tokenizer.encode(p) for p in HELD_OUT]
    before = _sampled_reward(params, cfg, method, held_out, tokenizer, reward, section)
    batches = []
    for step in range(20):
        epoch, index = divmod(step, data.steps_per_epoch)
        batches.append(data.batch(epoch, index, lambda: combine(state["params"], frozen)))
        if step == 0:  # the old policy is the one that sampled: the ratio's log starts at 0
            micro = {k: jnp.asarray(v[0]) for k, v in batches[0].items()}
            logp = jax.jit(lambda t, m: policy_and_reference_logps(run.context, t, frozen, None, m)[0])(
                state["params"], micro)
            np.testing.assert_allclose(logp * micro["loss_mask"], micro["old_logps"], atol=2e-5)
        state, metrics = run.step(state, frozen, None, {k: jnp.asarray(v) for k, v in batches[-1].items()})
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["entropy"]))
    for first, second in zip(batches[::2], batches[1::2]):
        assert all(np.array_equal(first[k], second[k]) for k in first)
    assert not np.array_equal(batches[0]["old_logps"], batches[2]["old_logps"])

    resumed = (GRPO if objective == "grpo" else RLOO).prepare(setup)  # a fresh process, the policy moved on
    again = resumed.batch(9, 1, lambda: combine(state["params"], frozen))
    assert all(np.array_equal(again[k], batches[19][k]) for k in again)
    with pytest.raises(JaxtuneError, match=r"step 2 of epoch 1 reuses the rollouts .* resume from a checkpoint at a "
                                           "multiple of num_iterations steps"):
        resumed.batch(0, 1, lambda: combine(state["params"], frozen))  # an older batch, no longer kept

    after = _sampled_reward(combine(state["params"], frozen), cfg, method, held_out, tokenizer, reward, section)
    assert before < 0.05 and after > 0.3, (before, after)  # half the samples of test_grpo_variants' runs


def test_num_iterations_needs_checkpoints_between_rollout_batches(tmp_path):
    section = GRPOConfig(reward="grpo_rewards.count_letter_a", max_new_tokens=8, num_iterations=2)
    with pytest.raises(JaxtuneError, match=r"^\[grpo\] num_iterations = 2 with \[train\] checkpoint_every = 5: "
                                           ".* use a multiple of 2$"):
        GRPO.prepare(_setup(tmp_path, section, checkpoint_every=5))


@pytest.mark.slow
def test_own_sampler_weights_are_1_through_prepare_and_the_step(tmp_path):
    """The keys together through GRPO's `prepare` and the spine's step (the batch fields the planner sees: old and
    sampler log-probs, tokens per micro-batch): with jaxtune's own sampler the importance weights are 1, so the step's
    loss and gradient norm equal those of the same run without the correction."""
    keys = dict(reward="grpo_rewards.count_letter_a", group_size=4, max_new_tokens=8, loss_type="cispo",
                epsilon_high=5.0, entropy_coef=0.01, top_entropy_quantile=0.5, mask_truncated_completions=True,
                soft_punish_cache=4)
    corrected = GRPOConfig(sampler_importance_sampling_correction=True, sampler_importance_sampling_mode="token_mask",
                           sampler_importance_sampling_clip_min=0.999, sampler_importance_sampling_clip_max=1.001,
                           **keys)
    setup = _setup(tmp_path, corrected, cache=False)
    cfg, method = setup.cfg, setup.config.method
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    batch = GRPO.prepare(setup).batch(0, 0, lambda: params)
    assert {"old_logps", "sampler_logps", "tokens_per_micro"} <= set(batch)
    assert batch["loss_mask"].sum() > 0 and np.all(batch["sampler_logps"] == batch["old_logps"])
    results = []
    for section, fields in ((corrected, batch), (GRPOConfig(**keys), {k: v for k, v in batch.items()
                                                                     if k not in ("old_logps", "sampler_logps")})):
        run = one_device_run(cfg, method, "grpo", total_steps=10, batch_size=4, seq_len=24, section=section)
        state = run.init_state(trainable, 0)
        _, metrics = run.step(state, frozen, None, {k: jnp.asarray(v) for k, v in fields.items()})
        results.append([float(metrics[k]) for k in ("loss", "grad_norm", "entropy")])
    assert np.all(np.isfinite(results)) and results[0][0] != 0
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)
