"""Several reward functions with weights (TRL 1.16's `reward_funcs` + `reward_weights`): the weighted sums, the
advantages of both `multi_objective_aggregation` modes and RLOO's, with functions that return None for some rows
(and a row none scores), equal TRL's own `_generate_and_score_completions`; so do the per-function metrics of the
step; a `jaxtune train` run logs each function's mean and std in metrics.jsonl and its eval; bad keys are one line."""

import json
from collections import defaultdict
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from test_grpo_variants import G, P, _scored_rollouts, _trl_scored
from test_objective_runs import run_config
from test_train import metric_lines

from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.objectives.grpo import GRPO, group_advantages
from jaxtune.objectives.reward_functions import column_weights, weighted_sum
from jaxtune.objectives.rloo import RLOO, RLOOConfig, reward_advantages, step_advantages
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

NAMES = ("format_reward", "accuracy_reward", "length_reward")
WEIGHTS = (0.5, 2.0, -0.25)


def _table(seed: int = 5) -> np.ndarray:
    """A reward table [P * G, 3] (NaN: the function returned None): the format reward skips some rows, row 5 no
    function scores, and the last group has one scorable row (8, by the format reward alone)."""
    table = np.random.default_rng(seed).random((P * G, 3)).astype(np.float32)
    table[[0, 3, 6, 7], 0] = np.nan
    table[5] = np.nan
    table[8, 1:] = np.nan
    table[9:] = np.nan
    return table


def _trl(trainer, table: np.ndarray, **fields) -> tuple[dict, dict]:
    """TRL's output and logged metrics for `table`'s rewards, weighted by WEIGHTS, named NAMES."""
    import torch

    r = _scored_rollouts()
    completions = [[5] * int(n) for n in r["lengths"]]
    metrics = {"train": defaultdict(list)}
    if trainer.__name__ == "GRPOTrainer":
        generated = lambda prompts: ([[1, 2]] * len(prompts), completions, None, ["c"] * len(prompts), None, {}, None,
                                     None)
        fields = dict(num_iterations=1, use_vllm=False, environment_factories=None, environments=None, tools=None,
                      _is_vlm=False, **fields)
    else:
        generated = lambda prompts: ([[1, 2]] * len(prompts), completions, ["c"] * len(prompts))
    out = _trl_scored(trainer, generated, {**r, "rewards": table}, reward_weights=torch.tensor(WEIGHTS),
                      reward_func_names=list(NAMES), _metrics=metrics, **fields)
    return out, {k: v[0] for k, v in metrics["train"].items()}


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("aggregation, scale", [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"),
                                                ("sum_then_normalize", "none"), ("normalize_then_sum", "group")])
def test_weighted_rewards_advantages_and_metrics_equal_trl(aggregation, scale):
    from trl.trainer.grpo_trainer import GRPOTrainer

    table = _table()
    out, logged = _trl(GRPOTrainer, table, beta=0.0, scale_rewards=scale, multi_objective_aggregation=aggregation)
    section = GRPOConfig(group_size=G, scale_rewards=scale, multi_objective_aggregation=aggregation,
                         reward=tuple(f"grpo_rewards.{n}" for n in NAMES), reward_weights=WEIGHTS)
    ours = group_advantages(table, section)
    np.testing.assert_allclose(ours, out["advantages"].numpy(), rtol=1e-6, atol=1e-6)
    assert ours[5] == 0 and np.all(ours[9:] == 0)  # no reward scored them
    batch = {"rewards": weighted_sum(table, column_weights(section)),
             **{f"rewards/{n}": jnp.asarray(c) for n, c in zip(NAMES, table.T)}}
    step_metrics = GRPO.batch_metrics(batch)  # what the step logs, over the batch's rows
    assert set(step_metrics) == {"reward"} | {f"rewards/{n}/{s}" for n in NAMES for s in ("mean", "std")}
    for key, value in step_metrics.items():
        assert float(value) == pytest.approx(logged[key], rel=1e-6), key


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("beta, clip_range, normalize", [(0.05, (), False), (0.1, (0.2, 1.5), True)])
def test_rloo_weighted_rewards_and_advantages_equal_trl(beta, clip_range, normalize):
    """RLOO's baseline over the group's scored rows (the KL's too, in the step), the normalisation over the rows with
    a baseline, 0 for the rest: jaxtune's two halves against TRL's RLOOTrainer (it has no aggregation modes)."""
    from trl.trainer.rloo_trainer import RLOOTrainer

    r, table = _scored_rollouts(), _table()
    out, logged = _trl(RLOOTrainer, table, beta=beta, reward_clip_range=clip_range or None,
                       normalize_advantages=normalize)
    rloo = RLOOConfig(group_size=G, kl_coef=beta, reward_clip_range=clip_range, normalize_advantages=normalize,
                      reward=tuple(f"grpo_rewards.{n}" for n in NAMES), reward_weights=WEIGHTS)
    kl = jnp.asarray(((r["logp"] - r["ref"]) * r["mask"]).sum(-1), jnp.float32)
    ours = step_advantages(jnp.asarray(reward_advantages(table, rloo)), kl, rloo)
    np.testing.assert_allclose(ours, out["advantages"].numpy(), rtol=1e-6, atol=1e-6)
    assert ours[5] == 0 and np.all(ours[8:] == 0)  # unscored, and a group's only scored row (no baseline)
    assert float(RLOO.batch_metrics({"rewards": jnp.asarray(weighted_sum(table, column_weights(rloo)))})["reward"]) \
        == pytest.approx(logged["reward"], rel=1e-6)


@pytest.mark.parametrize("keys, key, message", [
    ({"reward": ("a.f", "a.g"), "reward_weights": (1.0,)}, "reward_weights", r"has 1 weights for 2 rewards"),
    ({"reward": "a.f", "reward_model": "rm", "reward_weights": (1.0,)}, "reward_weights",
     r"has 1 weights for 2 rewards \(1 in reward \+ reward_model\)"),
    ({"reward": "a.f", "reward_weights": ("x",)}, "reward_weights", "must be a list of numbers"),
    ({"reward": ("a.f", "b.f")}, "reward", "names two rewards 'f'"),
    ({"reward": ("a.f", "")}, "reward", "must be a list of dotted paths"),
    ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation",
     "choose one of sum_then_normalize, normalize_then_sum")])
def test_bad_reward_keys_are_one_line_config_errors(keys, key, message):
    with pytest.raises(ConfigError, match=f"^{key} = .*: {message}") as error:
        GRPOConfig(**keys)
    assert "\n" not in str(error.value)


def test_bad_reward_keys_in_a_config_and_an_empty_list_are_one_line():
    with pytest.raises(JaxtuneError, match=r"grpo.reward_weights ?= ?\[1.0, 2.0, 3.0\]: has 3 weights for 2 rewards") \
            as error:
        load_run_config(None, ['grpo.reward=["a.f", "a.g"]', "grpo.reward_weights=[1.0, 2.0, 3.0]"])
    assert "\n" not in str(error.value)
    assert load_run_config(None, ['grpo.reward="a.f"']).section("grpo").reward == ("a.f",)  # one string: a list of one
    for objective, section in (("grpo", GRPOConfig), ("rloo", RLOOConfig)):
        config = SimpleNamespace(train=SimpleNamespace(grad_accum=1), data=SimpleNamespace(max_seq_len=16), method=None)
        setup = SimpleNamespace(config=config, section=section(reward=[]), tokenizer=None, cfg=None)
        with pytest.raises(JaxtuneError, match=rf"^\[{objective}\] set reward .* and/or reward_model .*, or else "
                                               "environment") as error:
            (GRPO if objective == "grpo" else RLOO).prepare(setup)
        assert "\n" not in str(error.value)



def test_a_checkpoint_saved_with_one_reward_string_resumes_with_the_list_of_it():
    """Checkpoints before `reward` took a list recorded it as a string: the same reward, not another config."""
    from jaxtune.train.resume import check_resume

    assert check_resume({"grpo.reward": "a.f"}, {"grpo.reward": ["a.f"]}, "c") == {}
    assert check_resume({"grpo.reward": ""}, {"grpo.reward": []}, "c") == {}
    with pytest.raises(JaxtuneError, match=r'grpo.reward = "a.f" there, \["a.f", "a.g"\] here'):
        check_resume({"grpo.reward": "a.f"}, {"grpo.reward": ["a.f", "a.g"]}, "c")


@pytest.mark.slow
@pytest.mark.full
def test_a_run_logs_each_reward_function_in_its_metrics_and_eval(tmp_path):
    """Two functions with weights through `jaxtune train`'s `fine_tune` (2 steps, an eval): metrics.jsonl holds each
    one's mean and std a step, TRL's names, and the evaluation each one's; prompts starting with "S" no function
    scores (logged, advantage 0), which leaves them out of the means."""
    write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.3, max_position_embeddings=64)
    for name, prompts in (("prompts", ["Write:", "Say:", "Go:", "Now:"]), ("held_out", ["Tell:", "Do:"])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = run_config(tmp_path, tmp_path / "grpo", "grpo", tmp_path / "prompts.jsonl", tmp_path / "held_out.jsonl",
                        train={"max_steps": 2, "batch_size": 2, "eval_every": 2},
                        grpo={"reward": ["grpo_rewards.letter_a_or_none", "grpo_rewards.short_or_none"],
                              "reward_weights": [1.0, 0.5], "group_size": 4, "max_new_tokens": 4})
    config.write_text(config.read_text().replace("max_seq_len = 48", "max_seq_len = 16"))
    logged = []
    result = fine_tune(load_run_config(config), log=logged.append)
    lines = metric_lines(tmp_path / "grpo")
    steps = [r for r in lines if "reward" in r]
    names = [f"rewards/{n}/{s}" for n in ("letter_a_or_none", "short_or_none") for s in ("mean", "std")]
    assert len(steps) == 2 and all(set(names) <= set(r) for r in steps), steps
    assert all(0 <= r["rewards/short_or_none/mean"] <= 1 for r in steps)
    evals = {f"eval_{n}" for n in names} | {"eval_reward"}
    assert result.eval_metrics.keys() == evals and all(np.isfinite(v) for v in result.eval_metrics.values())
    assert any(set(evals) <= set(r) for r in lines)
    assert any("every reward returned None for 4 of 8 completions" in line for line in logged), logged


@pytest.mark.slow
def test_functions_a_reward_model_and_the_soft_punishment_are_columns_of_one_table(tmp_path):
    """GRPO's `prepare` with a function that returns None for some rows, a reward model after it and the soft
    overlong punishment: the batch holds each one's column under its name, the reward model's its own scores of the
    rows' texts, `rewards` their weighted sum and `advantages` the table's; the evaluation reports each one but the
    punishment."""
    import jax
    from test_grpo_offpolicy import _setup

    from jaxtune.config import tiny_config
    from jaxtune.data.tokenizer import Tokenizer
    from jaxtune.methods.transform import apply_method
    from jaxtune.models.params import init_params
    from jaxtune.models.reward_model import add_reward_head, save_reward_model
    from jaxtune.objectives.grpo import reward_model_function
    from jaxtune.spine.model import load_reward_model

    rm_cfg = tiny_config(vocab_size=259, initializer_range=0.3, eos_token_id=(2,))
    rm = save_reward_model(tmp_path / "judge", rm_cfg, add_reward_head(init_params(rm_cfg, jax.random.key(3)), rm_cfg,
                                                                     jax.random.key(4)))
    Tokenizer.byte_level().save(rm)
    section = GRPOConfig(reward="grpo_rewards.letter_a_or_none", reward_model=str(rm), reward_weights=(1.0, 0.5),
                         soft_punish_cache=2, group_size=4, max_new_tokens=8)
    setup = _setup(tmp_path, section, cache=False)
    setup = SimpleNamespace(**{**vars(setup), "load_reward_model": load_reward_model})
    cfg, method = setup.cfg, setup.config.method
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    data = GRPO.prepare(setup)
    batch = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.batch(0, 0, lambda: params).items()}
    names = ("letter_a_or_none", rm.name, "soft_overlong_punishment_reward")
    assert set(GRPO.batch_fields(16, 24, section)) <= set(batch) and {f"rewards/{n}" for n in names} <= set(batch)
    table = np.stack([batch[f"rewards/{n}"] for n in names], axis=1)
    assert np.isnan(table[:, 0]).sum() == 4 and not np.isnan(table[:, 1:]).any()  # "Say:"'s group: None
    np.testing.assert_allclose(batch["rewards"], weighted_sum(table, (1.0, 0.5, 1.0)), rtol=1e-6)
    np.testing.assert_allclose(batch["advantages"], group_advantages(table, section), rtol=1e-6, atol=1e-6)
    tokenizer, starts, ends = setup.tokenizer, batch["loss_mask"].argmax(1), batch["segment_ids"].sum(1)
    prompts = [tokenizer.decode(ids[:s + 1].tolist()) for ids, s in zip(batch["input_ids"], starts)]
    completions = [tokenizer.decode(labels[s:n].tolist()) for labels, s, n in zip(batch["labels"], starts, ends)]
    judge = reward_model_function(str(rm), 24, load_reward_model)
    np.testing.assert_allclose(table[:, 1], judge(prompts, completions), rtol=1e-5, atol=1e-6)
    evaluated = data.evaluate(None, params)
    assert set(evaluated) == {"eval_reward"} | {f"eval_rewards/{n}/{s}" for n in names[:2] for s in ("mean", "std")}
