"""ORPO, CPO, SimPO and KTO in jaxtune: KTO's data (unpaired records, pairs split) and batches, the sections'
bad values and bad KTO records as one-line errors, and a short `jaxtune train` of each on the tiny preference data
of the DPO runs that moves its held-out preference metric the right way. Their losses against TRL's own code:
tests/test_preference_objectives_trl.py."""

import json

import numpy as np
import pytest
from test_objective_runs import evals, run_config, write_config
from test_preference import write_pairs
from test_train import metric_lines

from jaxtune.cli import main
from jaxtune.data.formats import labelled_examples
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.objectives.kto import kto_batch
from jaxtune.presets import write_random_model
from jaxtune.run_config import dump_run_config, load_run_config
from jaxtune.train.loop import fine_tune

QUIET = dict(log=lambda _: None)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny random Llama, the DPO runs' pairs (train 64, held out 32) and the same pairs as unpaired records."""
    root = tmp_path_factory.mktemp("preference_objectives")
    write_random_model(root / "model", "llama", seed=0, initializer_range=0.1)
    write_pairs(root / "pairs.jsonl", 64, 0)
    write_pairs(root / "held_out.jsonl", 32, 1)
    for name in ("pairs", "held_out"):
        records = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
        (root / f"{name}_unpaired.jsonl").write_text("".join(
            json.dumps({"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}) + "\n"
            for r in records for side in ("chosen", "rejected")))
    return root


def test_kto_reads_unpaired_records_and_splits_pairs(tmp_path):
    tokenizer = Tokenizer.byte_level()
    (tmp_path / "d.jsonl").write_text('{"prompt": "ab", "completion": "c", "label": true}\n'
                                      '{"prompt": "ab", "chosen": "de", "rejected": "f"}\n'
                                      '{"prompt": "g", "completion": "hijkl", "label": false}\n')
    examples = list(labelled_examples(tmp_path / "d.jsonl", tokenizer, 6))
    prompt_ab = tuple(tokenizer.encode("ab"))
    eos = (tokenizer.eos_id,)
    assert [(e.prompt, e.completion, e.label) for e in examples] == [
        (prompt_ab, tuple(tokenizer.encode("c", add_special_tokens=False)) + eos, (1,)),
        (prompt_ab, tuple(tokenizer.encode("de", add_special_tokens=False)) + eos, (1,)),
        (prompt_ab, tuple(tokenizer.encode("f", add_special_tokens=False)) + eos, (0,)),
        (tuple(tokenizer.encode("g")), tuple(tokenizer.encode("hijkl", add_special_tokens=False))[:4], (0,)),
    ]  # the last cut to max_seq_len = 6 with its 2 prompt ids (BOS, "g")


def test_kto_batch_rotates_completions_for_the_reference_point(tmp_path):
    """Rows 0..B-1: each example; rows B..2B-1: prompt_i + completion_(i-1) of the real ones (TRL's KL pairs), padding
    empty; "desirable" marks the desirable examples' own rows."""
    tokenizer = Tokenizer.byte_level()
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c, "label": label}) + "\n"
                                              for p, c, label in (("a", "xx", True), ("bb", "y", False),
                                                                  ("c", "zzz", True))))
    examples = list(labelled_examples(tmp_path / "d.jsonl", tokenizer, 16))
    batch = kto_batch(examples, 4, 16, mismatched=True)
    assert batch["input_ids"].shape == (8, 16)
    np.testing.assert_array_equal(batch["desirable"], [1, 0, 1, 0, 0, 0, 0, 0])
    for i, e in enumerate(examples):
        ids = e.prompt + e.completion
        np.testing.assert_array_equal(batch["input_ids"][i, :len(ids) - 1], ids[:-1])
        shifted = e.prompt + examples[i - 1].completion
        np.testing.assert_array_equal(batch["input_ids"][4 + i, :len(shifted) - 1], shifted[:-1])
        assert batch["loss_mask"][4 + i].sum() == len(examples[i - 1].completion)
    assert batch["loss_mask"][[3, 7]].sum() == 0
    assert kto_batch(examples, 4, 16, mismatched=False)["input_ids"].shape == (4, 16)


@pytest.mark.full
def test_pair_forward_reads_what_trl_reads(tmp_path):
    """ORPO's NLL covers the chosen rows' prompt and completion (TRL: "computed over the full prompt and response"),
    CPO's their completion and EOS; the pair log-probs are per-token means (ORPO, SimPO, IPO) or sums; empty pairs
    count nothing."""
    import jax

    from jaxtune.config import ForwardOptions, tiny_config
    from jaxtune.data.formats import load_preference_examples
    from jaxtune.models.params import init_params
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.cpo import pair_forward
    from jaxtune.objectives.dpo import pair_batch, row_logps

    write_pairs(tmp_path / "p.jsonl", 3, 0)
    pairs, _ = load_preference_examples(tmp_path / "p.jsonl", Tokenizer.byte_level(), 48)
    cfg = tiny_config(vocab_size=259)
    params, ctx = init_params(cfg, jax.random.key(0)), Context(cfg, None, ForwardOptions())
    batch = pair_batch(pairs, 4, 48)
    logps = np.asarray(row_logps(params, batch, ctx, None), np.float64)
    sums = (logps * batch["loss_mask"]).sum(-1)
    counts = batch["loss_mask"].sum(-1)
    chosen, rejected, real, nll, tokens = pair_forward(params, batch, ctx, None, True, "segment_ids")
    np.testing.assert_allclose(chosen[:3], sums[:3] / counts[:3], rtol=1e-5)
    np.testing.assert_allclose(rejected[:3], sums[4:7] / counts[4:7], rtol=1e-5)
    np.testing.assert_array_equal(real, [1, 1, 1, 0])
    assert tokens == sum(len(p.prompt) + len(p.chosen) - 1 for p in pairs)  # every target after the first token
    np.testing.assert_allclose(nll, -(logps[:4] * (batch["segment_ids"][:4] > 0)).sum(), rtol=1e-5)
    chosen, rejected, _, nll, tokens = pair_forward(params, batch, ctx, None, False, "loss_mask")
    np.testing.assert_allclose(chosen[:3], sums[:3], rtol=1e-5)
    assert tokens == sum(len(p.chosen) for p in pairs)
    np.testing.assert_allclose(nll, -sums[:4].sum(), rtol=1e-5)


def test_sections_read_back(tmp_path):
    sections = {"orpo": {"beta": 0.25}, "cpo": {"loss_type": "hinge", "beta": 0.2, "cpo_alpha": 0.5},
                "simpo": {"beta": 2.5, "simpo_gamma": 1.25, "label_smoothing": 0.1},
                "kto": {"loss_type": "apo_zero_unpaired", "desirable_weight": 1.33, "undesirable_weight": 1}}
    config = load_run_config(write_config(tmp_path / "c.toml", sections))
    assert config.section("simpo").loss_type == "simpo" and config.section("simpo").cpo_alpha == 0.0  # its defaults
    assert config.section("cpo").cpo_alpha == 0.5 and config.section("kto").undesirable_weight == 1.0
    (tmp_path / "back.toml").write_text(dump_run_config(config))
    assert load_run_config(tmp_path / "back.toml") == config


def test_bad_sections_and_kto_records_are_one_line_errors(data, tmp_path, capsys):
    root = data
    (tmp_path / "no_label.jsonl").write_text('{"prompt": "a", "completion": "b", "label": true}\n'
                                             '{"prompt": "a", "completion": "b"}\n')
    (tmp_path / "text_label.jsonl").write_text('{"prompt": "a", "completion": "b", "label": "yes"}\n')
    pairs = root / "pairs.jsonl"
    cases = [
        (run_config(root, tmp_path / "a", "orpo", pairs, orpo={"beta": 0.0}), "orpo.beta = 0.0: must be > 0"),
        (run_config(root, tmp_path / "b", "cpo", pairs, cpo={"loss_type": "kto"}),
         'cpo.loss_type = "kto": choose one of sigmoid, hinge, ipo, simpo'),
        (run_config(root, tmp_path / "c", "simpo", pairs, simpo={"simpo_gamma": -1.0}),
         "simpo.simpo_gamma = -1.0: must be >= 0"),
        (run_config(root, tmp_path / "d", "cpo", pairs, cpo={"cpo_alpha": -0.5}), "cpo.cpo_alpha = -0.5: must be >= 0"),
        (run_config(root, tmp_path / "e", "kto", pairs, kto={"loss_type": "sigmoid"}),
         'kto.loss_type = "sigmoid": choose one of kto, apo_zero_unpaired'),
        (run_config(root, tmp_path / "f", "kto", pairs, kto={"undesirable_weight": 0}),
         "kto.undesirable_weight = 0.0: must be > 0"),
        (run_config(root, tmp_path / "g", "kto", pairs, kto={"desirable_weight": 1.0, "beta": -1}),
         "kto.beta = -1.0: must be > 0"),
        (run_config(root, tmp_path / "h", "kto", tmp_path / "no_label.jsonl"),
         f"{tmp_path / 'no_label.jsonl'}:2: unpaired record is missing field 'label'"),
        (run_config(root, tmp_path / "i", "kto", tmp_path / "text_label.jsonl"),
         f"{tmp_path / 'text_label.jsonl'}:1: unpaired field 'label' must be true or false, got string"),
        (run_config(root, tmp_path / "j", "kto", pairs, train={"batch_size": 1}),
         "train.batch_size = 1 must be at least 2"),
    ]
    for config, message in cases:
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


RUNS = {  # objective: (its section, the held-out metric, a slice of what it starts at)
    "orpo": ({"beta": 0.5}, "eval_rewards/accuracies"),
    "cpo": ({}, "eval_rewards/accuracies"),
    "simpo": ({"beta": 2.0, "simpo_gamma": 0.5}, "eval_rewards/accuracies"),
    "kto": ({}, "eval_accuracy"),
}


@pytest.mark.slow
@pytest.mark.parametrize("objective", [pytest.param(o, marks=pytest.mark.full) if o in ("orpo", "simpo") else o
                                       for o in RUNS])  # their losses against TRL's stay everyday
def test_run_learns_held_out_preferences(data, tmp_path, objective):
    """8 steps of `jaxtune train` (LoRA, 16 pairs or 16 examples a step): the held-out preference metric (pairs won
    by the chosen completion's reward; KTO: completions whose reward has their label's sign) ends >= 0.9 and above
    where it began, its reward margin positive, and the metrics TRL logs are in metrics.jsonl."""
    root = data
    section, metric = RUNS[objective]
    train, held_out = ((root / "pairs_unpaired.jsonl", root / "held_out_unpaired.jsonl") if objective == "kto"
                       else (root / "pairs.jsonl", root / "held_out.jsonl"))
    config = run_config(root, tmp_path / objective, objective, train, held_out,
                        train={"max_steps": 8, "eval_every": 8}, **{objective: section})
    result = fine_tune(load_run_config(config), **QUIET)
    accuracy, margins = evals(tmp_path / objective, metric), evals(tmp_path / objective, "eval_rewards/margins")
    assert accuracy[-1] >= 0.9 and accuracy[-1] > accuracy[0], accuracy
    assert margins[-1] > max(margins[0], 0.0), margins
    assert result.eval_metrics[metric] == accuracy[-1]
    logged = {"orpo": {"nll_loss", "log_odds_ratio", "log_odds_chosen"}, "cpo": {"nll_loss"}, "simpo": {"nll_loss"},
              "kto": {"kl", "logps/chosen", "logps/rejected"}}[objective]
    record = [r for r in metric_lines(tmp_path / objective) if "loss" in r][-1]
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", *logged} <= set(record), record
    if objective == "kto":
        assert accuracy[0] == 0.0  # at step 0 the policy is the reference: every reward is 0
