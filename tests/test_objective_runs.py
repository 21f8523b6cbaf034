"""`jaxtune train` with each objective on tiny models: the effect each is for, exact resume, exports, bad input."""

import json
import os
import signal

import numpy as np
import pytest
from test_preference import write_pairs
from test_train import DEMO_DATA, metric_lines

from jaxtune.cli import main
from jaxtune.config import ForwardOptions
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.reward_model import reward_scores
from jaxtune.objectives import OBJECTIVES
from jaxtune.objectives.dpo import sequence_row
from jaxtune.presets import write_random_model
from jaxtune.run_config import dump_run_config, load_run_config
from jaxtune.spine.model import load_reward_model
from jaxtune.train.loop import fine_tune

QUIET = dict(log=lambda _: None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("objectives")
    write_random_model(root / "model", "llama", seed=0, initializer_range=0.1)
    write_pairs(root / "pairs.jsonl", 64, 0)
    write_pairs(root / "held_out.jsonl", 32, 1)
    (root / "sft.jsonl").write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:96]))
    return root


def write_config(path, sections: dict):
    """A TOML file from {section: {key: value}} (JSON scalars and arrays are TOML)."""
    lines = []
    for name, values in sections.items():
        lines += [f"[{name}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_config(root, out, objective, data, eval_data="", method=None, train=None, **sections):
    method = method or {}  # LoRA's options below, another kind's as given
    if method.get("kind", "lora") == "lora":
        method = {"kind": "lora", "rank": 8, "target_modules": ["all-linear"], **method}
    train = {"objective": objective, "output_dir": str(out), "batch_size": 16, "learning_rate": 5e-3,
             "schedule": "constant", "log_every": 1, **(train or {})}
    data = {"train": str(data), "eval": str(eval_data), "max_seq_len": 48}
    return write_config(out.parent / f"{out.name}.toml", {"model": {"path": str(root / "model")}, "method": method,
                                                          "data": data, "train": train, **sections})


def evals(run, key):
    return [r[key] for r in metric_lines(run) if key in r]


@pytest.mark.slow
@pytest.mark.full
def test_dpo_run_learns_held_out_preferences_resumes_exactly_and_evals(models, tmp_path, capsys):
    root = models
    config = run_config(root, tmp_path / "dpo", "dpo", root / "pairs.jsonl", root / "held_out.jsonl",
                        train={"max_steps": 24, "eval_every": 8, "checkpoint_every": 8}, dpo={"beta": 0.1})
    result = fine_tune(load_run_config(config), **QUIET)
    accuracy = evals(tmp_path / "dpo", "eval_rewards/accuracy")
    assert accuracy[0] == 0.0 and accuracy[-1] >= 0.9, accuracy  # at step 0 the policy is the reference
    assert result.result_path == tmp_path / "dpo" / "adapter"
    assert result.eval_metrics["eval_rewards/accuracy"] == accuracy[-1]
    train_records = [r for r in metric_lines(tmp_path / "dpo") if "loss" in r]
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "grad_norm",
            "skipped_steps"} <= set(train_records[-1])
    assert train_records[-1]["rewards/margin"] > 0 and (tmp_path / "dpo" / "loss.png").is_file()

    # SIGTERM during step 1, then the same config again: the same metrics.jsonl as the run never interrupted.
    interrupted = run_config(root, tmp_path / "int", "dpo", root / "pairs.jsonl", root / "held_out.jsonl",
                             train={"max_steps": 24, "eval_every": 8, "checkpoint_every": 8}, dpo={"beta": 0.1})

    def log(line):
        if line.startswith("training"):
            os.kill(os.getpid(), signal.SIGTERM)

    assert fine_tune(load_run_config(interrupted), log=log).interrupted
    assert fine_tune(load_run_config(interrupted), **QUIET).step == 24
    assert metric_lines(tmp_path / "int") == metric_lines(tmp_path / "dpo")

    # `jaxtune eval` on preference data with the adapter: the same held-out accuracy against the base.
    assert main(["eval", "--model", str(root / "model"), "--adapter", str(result.result_path), "--data",
                 str(root / "held_out.jsonl"), "--max-seq-len", "48", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["kind"] == "policy" and scores["pairs"] == 32
    assert scores["accuracy"] == pytest.approx(accuracy[-1])


@pytest.mark.slow
@pytest.mark.parametrize("method,reference", [("lora", "base"), ("full", "model")])
@pytest.mark.full
def test_precomputed_reference_logps_give_the_same_run(models, tmp_path, method, reference):
    """Scoring the pairs with the reference once before training (LoRA: the base with adapters off; full: a
    separate reference directory, then dropped) gives the step-for-step metrics of scoring them in every step."""
    root = models
    dpo = {"beta": 0.1, "loss": "ipo" if method == "full" else "sigmoid",
           "reference": str(root / "model") if reference == "model" else "base"}
    runs = {}
    for precompute in (False, True):
        out = tmp_path / f"{method}-{precompute}"
        config = run_config(root, out, "dpo", root / "pairs.jsonl", root / "held_out.jsonl",
                            method={"kind": "full"} if method == "full" else None,
                            train={"max_steps": 4, "eval_every": 2, "learning_rate": 1e-3},
                            dpo={**dpo, "precompute_reference": precompute})
        fine_tune(load_run_config(config), **QUIET)
        runs[precompute] = metric_lines(out)
    assert len(runs[True]) == len(runs[False]) == 7
    for a, b in zip(runs[False], runs[True]):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=f"{key} at step {a['step']}")


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.full
def test_reward_model_run_exports_what_transformers_scores_the_same(models, tmp_path, capsys):
    import torch
    import transformers

    root = models
    config = run_config(root, tmp_path / "rm", "reward", root / "pairs.jsonl", root / "held_out.jsonl",
                        train={"epochs": 2})
    result = fine_tune(load_run_config(config), **QUIET)
    accuracy = evals(tmp_path / "rm", "eval_accuracy")
    assert accuracy[-1] >= 0.9 > accuracy[0], accuracy
    assert result.result_path == tmp_path / "rm" / "reward_model"

    # transformers' sequence-classification model on the exported directory gives jaxtune's rewards.
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(result.result_path).eval()
    assert hf.config.num_labels == 1 and hf.score.weight.shape == (1, hf.config.hidden_size)
    assert main(["eval", "--model", str(result.result_path), "--data", str(root / "held_out.jsonl"), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["kind"] == "reward" and scores["accuracy"] == pytest.approx(accuracy[-1])
    tokenizer = Tokenizer.byte_level()
    cfg, params = load_reward_model(result.result_path)
    wins, margins = 0, []
    pairs = [json.loads(line) for line in (root / "held_out.jsonl").read_text().splitlines()]
    for pair in pairs:
        prompt = tokenizer.encode(pair["prompt"])
        ids = [prompt + tokenizer.encode(pair[k], add_special_tokens=False) for k in ("chosen", "rejected")]
        width = max(map(len, ids))  # right-padded batch: transformers reads the last non-pad token
        with torch.no_grad():
            theirs = hf(torch.tensor([x + [tokenizer.pad_id] * (width - len(x)) for x in ids])).logits[:, 0].numpy()
        rows = [sequence_row((*x, 0), len(prompt), 48) for x in ids]  # 0: a target no score reads
        ours = reward_scores(params, {k: np.stack([r[k] for r in rows]) for k in rows[0]}, cfg, None, ForwardOptions())
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-5)
        wins += theirs[0] > theirs[1]
        margins.append(theirs[0] - theirs[1])
    assert wins / len(pairs) == pytest.approx(scores["accuracy"])
    assert np.mean(margins) == pytest.approx(scores["margin"], rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.full
def test_grpo_run_raises_the_mean_reward_of_a_verifiable_task(tmp_path):
    """Prompt records carry an "answer" field the reward function checks (tests/grpo_rewards.py)."""
    write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.3, max_position_embeddings=64)
    rows = [{"prompt": p, "answer": "a"} for p in ["Write:", "Say:", "Go:", "Now:", "Then:"]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = run_config(tmp_path, tmp_path / "grpo", "grpo", tmp_path / "prompts.jsonl",
                        train={"max_steps": 25, "batch_size": 4, "learning_rate": 2e-2, "eval_every": 25},
                        grpo={"reward": "grpo_rewards.share_of_answer", "group_size": 8,
                                         "max_new_tokens": 8, "kl_coef": 0.0})
    config.write_text(config.read_text().replace("max_seq_len = 48", "max_seq_len = 24"))
    result = fine_tune(load_run_config(config, ["data.eval_fraction=0.2"]), **QUIET)
    rewards = [r["reward"] for r in metric_lines(tmp_path / "grpo") if "reward" in r]
    assert len(rewards) == 25 and "kl" in metric_lines(tmp_path / "grpo")[-2]
    assert np.mean(rewards[-5:]) > max(0.2, 3 * np.mean(rewards[:5])), rewards
    assert result.eval_metrics.keys() == {"eval_reward", "eval_rewards/share_of_answer/mean",
                                          "eval_rewards/share_of_answer/std"} and result.result_path.name == "adapter"


@pytest.mark.slow
@pytest.mark.full
def test_grpo_with_num_iterations_resumes_mid_rollout_batch_exactly(tmp_path):
    """num_iterations = 2: SIGTERM during step 1 (the checkpoint falls between the two steps of a rollout batch), then
    the same config again: step 2 reads the batch back from the run's directory, and metrics.jsonl is the run's never
    interrupted."""
    write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.3, max_position_embeddings=64)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "a"}) + "\n"
                                                   for p in ["Write:", "Say:", "Go:", "Now:"]))
    grpo = {"reward": "grpo_rewards.share_of_answer", "group_size": 4, "max_new_tokens": 8, "num_iterations": 2,
            "mask_truncated_completions": True, "soft_punish_cache": 2}
    train = {"max_steps": 4, "batch_size": 2, "learning_rate": 2e-2, "checkpoint_every": 2}
    configs = []
    for name in ("grpo", "int"):
        configs.append(run_config(tmp_path, tmp_path / name, "grpo", tmp_path / "prompts.jsonl", train=train,
                                  grpo=grpo))
        configs[-1].write_text(configs[-1].read_text().replace("max_seq_len = 48", "max_seq_len = 24"))
    fine_tune(load_run_config(configs[0], ["data.eval_fraction=0.0"]), **QUIET)

    def log(line):
        if line.startswith("training"):
            os.kill(os.getpid(), signal.SIGTERM)

    assert fine_tune(load_run_config(configs[1], ["data.eval_fraction=0.0"]), log=log).interrupted
    assert sorted(p.name for p in (tmp_path / "int" / "cache" / "rollouts").iterdir()) == ["0-0.npz"]
    assert fine_tune(load_run_config(configs[1], ["data.eval_fraction=0.0"]), **QUIET).step == 4
    assert metric_lines(tmp_path / "int") == metric_lines(tmp_path / "grpo")
    records = [r for r in metric_lines(tmp_path / "grpo") if "loss" in r]
    assert len(records) == 4 and all("entropy" in r for r in records)


@pytest.mark.slow
@pytest.mark.full
def test_distillation_run_lowers_held_out_kl(models, tmp_path):
    root = models
    teacher = write_random_model(tmp_path / "teacher", "llama", seed=7, hidden_size=96, initializer_range=0.15)
    config = run_config(root, tmp_path / "kd", "distill", root / "sft.jsonl",
                        train={"max_steps": 16, "batch_size": 8, "learning_rate": 1e-2, "eval_every": 16},
                        distill={"teacher": str(teacher), "alpha": 1.0, "temperature": 2.0})
    config.write_text(config.read_text().replace("max_seq_len = 48", "max_seq_len = 64"))
    result = fine_tune(load_run_config(config, ["data.eval_fraction=0.3"]), **QUIET)
    kl = evals(tmp_path / "kd", "eval_kl")
    assert kl[-1] < 0.85 * kl[0], kl
    record = [r for r in metric_lines(tmp_path / "kd") if "loss" in r][-1]
    assert record["loss"] == pytest.approx(record["kl"], rel=1e-5) and "nll" in record  # alpha = 1: all KL
    assert result.result_path.name == "adapter"


@pytest.mark.slow
@pytest.mark.full
def test_on_policy_distillation_run_lowers_held_out_divergence(models, tmp_path):
    """GKD with lmbda = 1: every step trains (a full fine-tune) on the student's own samples, decoded under the run's
    mesh, and the generalised JSD (beta = 0.5) to the teacher on the held-out dataset completions falls."""
    root = models
    teacher = write_random_model(tmp_path / "teacher", "llama", seed=7, hidden_size=96, initializer_range=0.15)
    config = run_config(root, tmp_path / "gkd", "distill", root / "sft.jsonl", method={"kind": "full"},
                        train={"max_steps": 8, "batch_size": 8, "learning_rate": 3e-3, "eval_every": 8},
                        distill={"teacher": str(teacher), "alpha": 1.0, "beta": 0.5, "lmbda": 1.0,
                                 "max_new_tokens": 16, "sampling_temperature": 1.0})
    fine_tune(load_run_config(config, ["data.eval_fraction=0.3"]), **QUIET)
    jsd = evals(tmp_path / "gkd", "eval_kl")
    assert jsd[-1] < 0.85 * jsd[0], jsd  # measured: 0.261 -> 0.204 (-22%) after 8 steps; 13 s, 45 s compiling
    assert all(r["on_policy"] == 1.0 for r in metric_lines(tmp_path / "gkd") if "loss" in r)


def test_config_round_trips_every_objective_section(tmp_path):
    sections = {"train": {"objective": "grpo", "batch_size": 2},
                "dpo": {"loss": "ipo", "beta": 0.5, "label_smoothing": 0.1, "reference": "ref/model"},
                "grpo": {"reward_model": "rm/", "group_size": 6, "top_k": 5, "top_p": 0.9, "clip": 0.3},
                "distill": {"teacher": "t", "alpha": 1.0, "temperature": 2, "beta": 0.5, "lmbda": 0.5, "seq_kd": True}}
    config = load_run_config(write_config(tmp_path / "c.toml", sections))
    assert config.section("distill").temperature == 2.0 and config.section("grpo").top_k == 5
    assert config.section("distill").lmbda == 0.5 and config.section("distill").seq_kd
    assert config.train.objective == "grpo"
    (tmp_path / "back.toml").write_text(dump_run_config(config))
    assert load_run_config(tmp_path / "back.toml") == config


def test_a_rollout_without_room_for_its_prompt_is_refused_at_load(tmp_path):
    sections = {"train": {"objective": "distill"}, "data": {"max_seq_len": 48},
                "distill": {"teacher": "t", "alpha": 1.0, "lmbda": 0.5, "max_new_tokens": 48}}
    with pytest.raises(JaxtuneError, match=r"\[distill\] max_new_tokens = 48 leaves no room for a prompt in \[data\] "
                                           r"max_seq_len = 48; use at most 47"):
        load_run_config(write_config(tmp_path / "c.toml", sections))
    sections["distill"]["lmbda"] = 0.0  # offline: nothing sampled, nothing to fit
    assert load_run_config(write_config(tmp_path / "c.toml", sections)).section("distill").max_new_tokens == 48
    on_policy = ["mesh.context=2", "train.objective=distill", "distill.alpha=1.0", "distill.lmbda=0.5"]
    with pytest.raises(JaxtuneError, match=r"objective = 'distill' with \[mesh\] context = 2: its rollouts decode"):
        load_run_config(None, on_policy)
    assert load_run_config(None, on_policy[:-1]).mesh.context == 2  # offline distillation splits its rows
    with pytest.raises(JaxtuneError, match=r"objective = 'distill' with \[mesh\] context = 2: its rollouts decode"):
        load_run_config(None, [*on_policy[:-1], "distill.seq_kd=true"])  # the teacher decodes


def test_bad_objective_inputs_are_one_line_errors(models, tmp_path, capsys):
    root = models
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                                        '{"prompt": "a", "chosen": "b"}\n')
    write_random_model(tmp_path / "big_vocab", "llama", vocab_size=300)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Go:"}\n' * 4)
    cases = [
        (run_config(root, tmp_path / "a", "dpo", tmp_path / "bad.jsonl"),
         f"{tmp_path / 'bad.jsonl'}:2: preference record is missing field 'rejected'"),
        (run_config(root, tmp_path / "b", "distill", root / "sft.jsonl",
                    distill={"teacher": str(tmp_path / "big_vocab")}),
         "teacher vocabulary has 300 tokens, the student's 259"),
        (run_config(root, tmp_path / "c", "grpo", tmp_path / "prompts.jsonl", grpo={"reward": "nowhere.rewards.exact"}),
         "reward 'nowhere.rewards.exact' cannot be imported"),
        (run_config(root, tmp_path / "d", "ppo", root / "sft.jsonl"),
         'train.objective = "ppo": choose one of ' + ", ".join(OBJECTIVES)),
        (run_config(root, tmp_path / "e", "dpo", root / "pairs.jsonl", dpo={"betta": 0.1}),
         "unknown key 'betta' in section [dpo]"),
    ]
    for config, message in cases:
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "reward", "distill"])
@pytest.mark.full
def test_lora_dropout_reaches_every_objective_and_is_deterministic(models, tmp_path, objective):
    """With [method] dropout the policy's forward drops the adapters' inputs (B = 0 at step 1, so the loss is
    unchanged but A's gradient is not): the grad norm moves, and the same config gives the same run again."""
    root = models
    data = root / ("sft.jsonl" if objective == "distill" else "pairs.jsonl")
    extra = {"distill": {"teacher": str(root / "model")}} if objective == "distill" else {}
    norms = {}
    for name, rate in (("none", 0.0), ("a", 0.3), ("b", 0.3)):
        out = tmp_path / f"{objective}-{name}"
        config = run_config(root, out, objective, data, method={"dropout": rate},
                            train={"max_steps": 2, "batch_size": 8}, **extra)
        fine_tune(load_run_config(config, ["data.eval_fraction=0.25"]), **QUIET)
        norms[name] = [r["grad_norm"] for r in metric_lines(out) if "grad_norm" in r]
    assert norms["a"] == norms["b"]
    assert abs(norms["a"][0] - norms["none"][0]) > 1e-3 * norms["none"][0], norms
