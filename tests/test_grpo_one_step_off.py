"""One-step-off rollouts (`[grpo] off_policy_steps = 1`, issue 51): step t trains on the batch sampled with the
parameters step t - 1 started from (steps 1 and 2: the initial ones), decoded before step t - 1 was dispatched and
scored while it ran; its `old_logps` are the sampling parameters', so the step's loss is TRL's `_compute_loss` with
that old policy (a ratio other than 1 from step 2 on); a run stopped and resumed equals one never stopped; the
trainer scores step t + 1's batch before it reads step t's metrics."""

import dataclasses
import json
import os
import signal
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from steps import one_device_run
from test_grpo_offpolicy import _setup
from test_grpo_variants import _trl_self
from test_objective_runs import QUIET, run_config
from test_train import metric_lines

import jaxtune.train.loop as loop
from jaxtune.config import TrainConfig
from jaxtune.errors import ConfigError
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.params import init_params
from jaxtune.objectives.grpo import GRPO, policy_and_reference_logps
from jaxtune.objectives.losses import sampler_weights
from jaxtune.objectives.rloo import RLOOConfig
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

KEYS = dict(reward="grpo_rewards.odd_characters", group_size=4, max_new_tokens=8, kl_coef=0.04)


def _trl_loss(g: GRPOConfig, logp, old, ref, advantages, mask, weights=None) -> float:
    """TRL 1.16's `GRPOTrainer._compute_loss` of one micro-batch (grad_accum 1) given the per-token log-probs [B, T]
    of the policy, the old policy and the reference, the advantages [B], the mask [B, T] and the sampler's importance
    weights (`importance_sampling_ratio`, vLLM's correction; None: none), in float64."""
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, T = mask.shape
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    trl_self = _trl_self(args=args, loss_type=g.loss_type, importance_sampling_level=g.importance_sampling_level,
                         beta=g.kl_coef, epsilon_low=g.clip, epsilon_high=g.clip_high, max_completion_length=T)
    trl_self.current_gradient_accumulation_steps = 1
    trl_self.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    trl_self.use_vllm = trl_self.vllm_importance_sampling_correction = weights is not None
    as64 = lambda x: torch.tensor(np.asarray(x, np.float64))
    trl_self._get_per_token_logps_and_entropies = lambda *_, **__: (as64(logp), torch.zeros(B, T), None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": as64(mask),
              "advantages": as64(advantages), "old_per_token_logps": as64(old), "ref_per_token_logps": as64(ref),
              "num_items_in_batch": as64(mask.sum())}
    if weights is not None:
        inputs["importance_sampling_ratio"] = as64(weights)
    return float(GRPOTrainer._compute_loss(trl_self, None, inputs))


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("engine, corrected", [("padded", False), pytest.param("padded", True, marks=pytest.mark.full),
                                               pytest.param("paged", False, marks=pytest.mark.full)])
def test_step_t_trains_on_the_batch_of_step_t_minus_1s_params_with_trls_loss(tmp_path, engine, corrected):
    """The trainer's order through GRPO's own `prepare` and the spine's (donating) step, one prompt batch an epoch:
    step t's batch is the batch a synchronous run samples for step t with the parameters step t - 1 started from
    (step 1's and step 2's: the initial ones), their log-probs included, as `old_logps`, or with the sampler's
    correction as `sampler_logps`; the step's loss is TRL's with those old log-probs, or with the step's own as the
    old and the masked importance weights of the sampling policy (vLLM's correction), and from step 2 on the ratio
    to the sampling policy is not 1. A fresh process (a resumed run) reads the batch sampled ahead back from the
    run's directory; one no longer kept is sampled with the parameters given, and said so."""
    correction = dict(sampler_importance_sampling_correction=True, sampler_importance_sampling_mode="token_mask",
                      sampler_importance_sampling_clip_min=0.999, sampler_importance_sampling_clip_max=1.001)
    section = GRPOConfig(**KEYS, rollout_engine=engine, off_policy_steps=1, **(correction if corrected else {}))
    behaviour_key = "sampler_logps" if corrected else "old_logps"
    # the synchronous reference: the same section, a batch sampled at its own step (its log-probs as both)
    reference = dataclasses.replace(section, off_policy_steps=0, **correction)
    setup = _setup(tmp_path, section)
    cfg, method = setup.cfg, setup.config.method
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    run = one_device_run(cfg, method, "grpo", train=TrainConfig(learning_rate=2e-2, schedule="constant"),
                         total_steps=100, batch_size=4, seq_len=24, section=section)
    data, synchronous = GRPO.prepare(setup), GRPO.prepare(_setup(tmp_path, reference, cache=False))
    assert data.ahead is not None and synchronous.ahead is None and data.steps_per_epoch == 1
    state = run.init_state(trainable, 0)
    logps = jax.jit(lambda t, m: policy_and_reference_logps(run.context, t, frozen, None, m)[:2])
    starts, steps, stale = [], 3, 0
    for step in range(1, steps + 1):
        starts.append(jax.device_get(state["params"]))  # the params step `step` starts from (host copies)
        batch = data.batch(step - 1, 0, lambda: combine(state["params"], frozen))
        finish = data.ahead(step, 0, lambda: combine(state["params"], frozen))  # before the step donates them
        micro = {k: jnp.asarray(v[0]) for k, v in batch.items()}
        logp, ref = logps(state["params"], micro)
        state, metrics = run.step(state, frozen, None, {k: jnp.asarray(v) for k, v in batch.items()})
        ahead = finish()

        behaviour = starts[max(step - 2, 0)]
        expected = synchronous.batch(step - 1, 0, lambda: combine(jax.device_put(behaviour), frozen))
        assert batch.keys() == expected.keys() - {"old_logps" if corrected else "sampler_logps"}
        for k in batch:
            np.testing.assert_array_equal(batch[k], expected[k], err_msg=f"step {step}: {k}")
        mask = np.asarray(micro["loss_mask"])
        log_ratio = (np.asarray(logp) - batch[behaviour_key][0]) * mask
        moved = any(np.any(a != b) for a, b in zip(jax.tree.leaves(starts[-1]), jax.tree.leaves(behaviour)))
        assert moved == (step > 1 and np.abs(log_ratio).max() > 1e-4), step  # the ratio is 1 where nothing moved
        assert moved or np.abs(log_ratio).max() < 2e-5, step
        stale += moved
        if corrected:  # the old policy is the step's; the sampling policy's weights, TRL's (test_grpo_offpolicy.py)
            weights = np.asarray(sampler_weights(logp, micro["sampler_logps"], micro["loss_mask"],
                                                 section.sampler_importance_sampling_mode, *section.sampler_clip))
            assert (weights[mask > 0] == 0).any() == moved, step  # tokens masked where the sampler lagged
            trl = _trl_loss(section, logp, logp, ref, batch["advantages"][0], mask, weights)
        else:
            trl = _trl_loss(section, logp, batch["old_logps"][0], ref, batch["advantages"][0], mask)
        assert float(metrics["loss"]) == pytest.approx(trl, rel=2e-4, abs=1e-6), step
    assert stale >= 1  # a step whose behaviour policy was one update behind

    said: list = []
    resumed = GRPO.prepare(dataclasses.replace(setup, log=said.append))  # a fresh process, the policy moved on
    said.clear()  # the data's line
    again = resumed.batch(steps, 0, lambda: combine(state["params"], frozen))
    assert again.keys() == ahead.keys() and all(np.array_equal(again[k], ahead[k]) for k in again) and not said
    resumed.batch(1, 0, lambda: combine(state["params"], frozen))  # step 2's: only the newest two are kept
    assert said == [f"[grpo] step 2: no rollout batch sampled ahead for it (in memory or {tmp_path}/cache/rollouts); "
                    "sampled now with the current parameters"]


@pytest.mark.parametrize("keys, named", [({"num_iterations": 2}, "num_iterations"),
                                         ({"environment": "tools"}, "environment"),
                                         ({"sampler_url": "http://127.0.0.1:1", "sampler_model": "m",
                                          "sampler_adapter_dir": "/tmp/a"}, "sampler_url")])
@pytest.mark.parametrize("section", [GRPOConfig, RLOOConfig])
def test_one_step_off_is_refused_where_it_cannot_work(section, keys, named):
    keys = {"reward": "" if "environment" in keys else "r.f", **keys}
    with pytest.raises(ConfigError, match=rf"^off_policy_steps = 1: .* unset {named} or set off_policy_steps = 0$"):
        section(**keys, off_policy_steps=1)
    with pytest.raises(ConfigError, match=r"^off_policy_steps = 2: "):
        section(reward="r.f", off_policy_steps=2)


def _config(tmp_path, name: str, objective: str, max_steps: int):
    write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.3, max_position_embeddings=64)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "a"}) + "\n"
                                                   for p in ["Write:", "Say:", "Go:", "Now:"]))
    keys = {**KEYS, "reward": "grpo_rewards.recorded_share_of_answer", "off_policy_steps": 1}
    train = {"max_steps": max_steps, "batch_size": 2, "learning_rate": 2e-2, "checkpoint_every": 2}
    config = run_config(tmp_path, tmp_path / name, objective, tmp_path / "prompts.jsonl", train=train,
                        **{objective: keys})
    config.write_text(config.read_text().replace("max_seq_len = 48", "max_seq_len = 24"))
    return load_run_config(config, ["data.eval_fraction=0.0"])


class _Read:
    """A metric whose reading (`flush`'s `.item()`) is recorded in `events`."""

    def __init__(self, value, step: int, events: list):
        self.value, self.step, self.events = value, step, events

    def item(self):
        self.events.append(("read", self.step))
        return np.asarray(self.value).item()


@pytest.mark.slow
def test_the_trainer_scores_the_next_batch_before_it_reads_the_steps_metrics(tmp_path, monkeypatch):
    """Through `fine_tune`: each step's batch after the first is scored (the reward called) after the step before it
    is dispatched and before that step's metrics are read, so the host scores while the device runs the step; a
    run's last step samples nothing ahead."""
    import grpo_rewards

    events: list = []
    started = loop.start_run

    def start_run(config, log):
        task = started(config, log)
        step = task.run.step

        def recorded(state, frozen, second, batch):
            number = 1 + sum(e[0] == "dispatch" for e in events)
            events.append(("dispatch", number))
            state, metrics = step(state, frozen, second, batch)
            return state, {k: _Read(v, number, events) for k, v in metrics.items()}

        task.run.__dict__["step"] = recorded  # the cached property's slot
        return task

    monkeypatch.setattr(loop, "start_run", start_run)
    monkeypatch.setattr(grpo_rewards, "EVENTS", events)
    fine_tune(_config(tmp_path, "run", "grpo", 3), **QUIET)
    at = {e: events.index(e) for e in events}  # each event's first time
    assert sorted(e for e in at if e[0] == "reward") == [("reward", t) for t in (1, 2, 3)], events
    assert at[("reward", 1)] < at[("dispatch", 1)], events  # the first batch: sampled and scored at its step
    for t in (1, 2):
        assert at[("dispatch", t)] < at[("reward", t + 1)] < min(at[("read", t)], at[("dispatch", t + 1)]), events


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_one_step_off_run_resumes_exactly(tmp_path, objective):
    """SIGTERM during step 1 of 5 (checkpoint_every 2): the run stops after step 1, with step 2's batch (sampled
    with the initial parameters) in the run's directory; the same config again reads it back, and metrics.jsonl and
    the adapter equal those of the run never stopped."""
    fine_tune(_config(tmp_path, "whole", objective, 5), **QUIET)

    def log(line):
        if line.startswith("training"):
            os.kill(os.getpid(), signal.SIGTERM)

    assert fine_tune(_config(tmp_path, "int", objective, 5), log=log).interrupted
    assert sorted(p.name for p in (tmp_path / "int" / "cache" / "rollouts").iterdir()) == ["0-1.npz"]
    assert fine_tune(_config(tmp_path, "int", objective, 5), **QUIET).step == 5
    assert metric_lines(tmp_path / "int") == metric_lines(tmp_path / "whole")
    records = [r for r in metric_lines(tmp_path / "whole") if "loss" in r]
    assert len(records) == 5
    whole, resumed = (load_file(tmp_path / name / "adapter" / "adapter_model.safetensors") for name in ("whole", "int"))
    assert whole.keys() == resumed.keys() and all(np.array_equal(whole[k], resumed[k]) for k in whole)


def test_the_store_keeps_the_batches_since_the_last_checkpoint(tmp_path):
    """One-step-off keeps checkpoint_every + 1 batches (a run killed between checkpoints resumes from the last one);
    `find` is None for one no longer kept, from memory or disk."""
    from jaxtune.objectives.rollout_store import RolloutStore

    store = RolloutStore(tmp_path, keep=3)
    for index in range(5):
        store.put(0, index, {"x": np.full(2, index)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-2.npz", "0-3.npz", "0-4.npz"]
    fresh = RolloutStore(tmp_path, keep=3)
    assert fresh.find(0, 1) is None and fresh.find(0, 2)["x"].tolist() == [2, 2]
