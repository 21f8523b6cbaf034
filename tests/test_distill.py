"""Distillation lowers the student-teacher KL on held-out data; a teacher with another vocabulary is refused; GKD's
on-policy and sequence-level (seq_kd) batches are the student's and the teacher's samples, drawn as TRL 1.16's
GKDTrainer draws them, and their loss is TRL's."""

import re
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import one_device_run

from jaxtune.config import DataConfig, ForwardOptions, OffloadConfig, SamplingConfig, TrainConfig, tiny_config
from jaxtune.data.batching import epoch_batches
from jaxtune.data.formats import load_sft_examples
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.generation import generate
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.head import head_logits
from jaxtune.models.hf_config import load_config
from jaxtune.models.llama import decoder
from jaxtune.models.params import init_params
from jaxtune.objectives import distill
from jaxtune.objectives.base import Context, ObjectiveInputs
from jaxtune.objectives.distill import DISTILL, DistillConfig, check_teacher, mixed_batches, prompt_of
from jaxtune.objectives.losses import generalized_jsd
from jaxtune.presets import write_random_model
from jaxtune.rollouts import PagePool, sample_groups
from jaxtune.run_config import load_run_config

DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("reverse", [pytest.param(False, marks=pytest.mark.full), True])
def test_distillation_lowers_held_out_kl(tmp_path, reverse):
    (tmp_path / "d.jsonl").write_text("".join(DATA.read_text().splitlines(keepends=True)[:96]))
    examples, _ = load_sft_examples(tmp_path / "d.jsonl", Tokenizer.byte_level(), 64)
    train, held_out = examples[:64], examples[64:]
    teacher_cfg = tiny_config(vocab_size=259, hidden_size=96, num_layers=3, initializer_range=0.15)
    teacher = jax.jit(init_params, static_argnums=0)(teacher_cfg, jax.random.key(7))
    cfg = tiny_config(vocab_size=259, initializer_range=0.1)
    method = method_config("full") if reverse else method_config("lora", rank=8, target_modules=("all-linear",))
    params = apply_method(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)), cfg, method,
                          jax.random.key(1))
    trainable, frozen = partition(params, trainable_mask(params, method))
    tc = TrainConfig(learning_rate=1e-2, schedule="constant")
    distill = DistillConfig(teacher="teacher/dir", alpha=1.0, temperature=2.0, reverse=reverse)
    run = one_device_run(cfg, method, "distill", train=tc, total_steps=40, batch_size=8, seq_len=64, section=distill,
                         second_model=teacher_cfg)

    def held_out_kl(state):
        sums = [run.eval_step(combine(state["params"], frozen), teacher, b)
                for b in epoch_batches(held_out, 8, 64, 0, 0)]
        return sum(float(s["kl"]) for s in sums) / sum(float(s["tokens"]) for s in sums)

    state = run.init_state(trainable, 0)
    before = held_out_kl(state)
    for epoch in range(4):
        for batch in epoch_batches(train, 8, 64, 0, epoch):
            state, metrics = run.step(state, frozen, teacher, {k: v[None] for k, v in batch.items()})
    assert held_out_kl(state) < 0.85 * before  # measured: about -22% (LoRA) after 32 steps


def test_teacher_with_another_vocabulary_is_refused():
    with pytest.raises(JaxtuneError, match="teacher vocabulary has 300 tokens, the student's 259"):
        check_teacher(tiny_config(vocab_size=259), tiny_config(vocab_size=300), "teacher")


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (1.0, 1.0), (0.5, 1.0), (0.1, 0.7), (0.9, 2.0),
                                               (0.0, 2.0), (1.0, 0.5)])
def test_generalized_jsd_equals_trl_loss_and_gradient(beta, temperature):
    """`losses.generalized_jsd` summed over the tokens with labels != -100 and divided by their count equals TRL 1.16's
    `GKDTrainer.generalized_jsd_loss` (reduction "batchmean"), value and gradient w.r.t. the student's logits."""
    torch = pytest.importorskip("torch")
    gkd = pytest.importorskip("trl.experimental.gkd")
    rng = np.random.default_rng(0)
    student, teacher = (rng.normal(0, 2, (3, 7, 13)).astype(np.float32) for _ in range(2))
    labels = rng.integers(0, 13, (3, 7))
    labels[:, :2], labels[2, 5:] = -100, -100  # prompts and padding

    def ours(student_BxTxV):
        mask = jnp.asarray(labels != -100, jnp.float32)
        return jnp.sum(generalized_jsd(student_BxTxV, jnp.asarray(teacher), beta, temperature) * mask) / mask.sum()

    value, grad = jax.value_and_grad(ours)(jnp.asarray(student))
    s = torch.tensor(student, requires_grad=True)
    trl = gkd.GKDTrainer.generalized_jsd_loss(s, torch.tensor(teacher), torch.tensor(labels), beta=beta,
                                              temperature=temperature, reduction="batchmean")
    trl.backward()
    np.testing.assert_allclose(float(value), trl.item(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), s.grad.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", ["padded", pytest.param("paged", marks=pytest.mark.full)])
def test_on_policy_batch_labels_the_students_own_samples_and_masks_the_prompt(tmp_path, engine):
    """With lmbda = 1 a step's batch is the student's completions (sampled with its current parameters and the step's
    seed, by the padded decode or the paged engine) of the step's prompts: its labels are the sampled tokens, EOS
    included, the prompt masked; the same step draws the same batch again (a resumed run), and lmbda = 0.5 mixes on-
    and off-policy steps by the seed."""
    (tmp_path / "d.jsonl").write_text("".join(DATA.read_text().splitlines(keepends=True)[:16]))
    tok = Tokenizer.byte_level()
    train, _ = load_sft_examples(tmp_path / "d.jsonl", tok, 64)
    cfg = tiny_config(vocab_size=259, initializer_range=0.1)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    config = SimpleNamespace(train=TrainConfig(batch_size=2, grad_accum=2, seed=3), data=DataConfig(max_seq_len=64),
                             offload=OffloadConfig(), method=None)
    section = DistillConfig(teacher="t", alpha=1.0, lmbda=1.0, max_new_tokens=6, sampling_temperature=1.0,
                            rollout_engine=engine, rollout_slots=3, rollout_page_size=4)
    setup = ObjectiveInputs(config, section, cfg, tok, log=lambda _: None)
    batch = mixed_batches(setup, train, off_policy=None)(0, 1, lambda: params)
    assert batch["input_ids"].shape[:2] == (2, 2) and np.all(batch["on_policy"] == 1)
    draw = np.random.default_rng([3, 0, 1])
    draw.random()
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=int(draw.integers(2**31)))
    rows = {k: v.reshape(4, -1) for k, v in batch.items() if v.ndim == 3}
    prompts = [list(rows["input_ids"][r, :int(np.argmax(rows["loss_mask"][r] > 0)) + 1]) for r in range(4)]
    assert all(p in [prompt_of(e) for e in train] for p in prompts)
    completions = (generate(params, cfg, prompts, sampling, eos_ids=[tok.eos_id], include_stop=True) if
                   engine == "padded" else sample_groups(params, cfg, prompts, 1, sampling, pool=PagePool(3, 4),
                                                         eos_ids=[tok.eos_id], include_stop=True).tokens)
    for r, completion in enumerate(completions):
        start, mask = len(prompts[r]) - 1, rows["loss_mask"][r]
        assert mask[:start].sum() == 0 and mask.sum() == len(completion)  # the prompt masked, every sample a label
        assert list(rows["labels"][r, start:start + len(completion)]) == completion
    again = mixed_batches(setup, train, off_policy=None)(0, 1, lambda: params)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)

    half = replace(section, lmbda=0.5)
    off = lambda epoch, index, _params: {"loss_mask": np.zeros((2, 2, 64), np.float32)}
    mixed = mixed_batches(ObjectiveInputs(config, half, cfg, tok, log=lambda _: None), train, off)
    kinds = [float(mixed(0, i, lambda: params)["on_policy"].mean()) for i in range(8)]
    expected = [float(np.random.default_rng([3, 0, i]).random() < 0.5) for i in range(8)]
    assert kinds == expected and 0 < sum(kinds) < 8, kinds


def _gkd_setup(tmp_path, section: DistillConfig, cfg, offload=OffloadConfig()) -> tuple[ObjectiveInputs, list]:
    (tmp_path / "d.jsonl").write_text("".join(DATA.read_text().splitlines(keepends=True)[:16]))
    tok = Tokenizer.byte_level()
    train, _ = load_sft_examples(tmp_path / "d.jsonl", tok, 64)
    config = SimpleNamespace(train=TrainConfig(batch_size=2, grad_accum=2, seed=3), data=DataConfig(max_seq_len=64),
                             offload=offload, method=None)
    return ObjectiveInputs(config, section, cfg, tok, log=lambda _: None), train


def _logits(params, cfg, rows: dict) -> np.ndarray:
    hidden = decoder(params, jnp.asarray(rows["input_ids"]), cfg, positions_BxT=jnp.asarray(rows["positions"]),
                     segment_ids_BxT=jnp.asarray(rows["segment_ids"]))
    return np.asarray(head_logits(params, hidden, cfg.final_logit_softcap))


@pytest.mark.full
@pytest.mark.reference
def test_seq_kd_batch_is_the_teachers_samples_and_its_loss_is_trls(tmp_path):
    """With seq_kd (lmbda = 0) a step's batch is the teacher's completions of the step's prompts, decoded with the
    teacher's weights the trainer hands over at `start` and its own architecture, max_new_tokens,
    sampling_temperature and the step's seed (what `generate` gives on the teacher); labels are its tokens, EOS
    included, the prompt masked; `on_policy` 0; the student is not asked. The step's divergence over it equals TRL
    1.16's `generalized_jsd_loss` on the same logits and labels (the prompt and what follows EOS at -100, as
    `generate_on_policy_outputs` builds them)."""
    torch = pytest.importorskip("torch")
    gkd = pytest.importorskip("trl.experimental.gkd")
    (tmp_path / "d.jsonl").write_text("".join(DATA.read_text().splitlines(keepends=True)[:16]))
    teacher_dir = write_random_model(tmp_path / "teacher", "llama", seed=7, hidden_size=96, num_layers=3)
    teacher_cfg = load_config(teacher_dir)
    cfg = tiny_config(vocab_size=259, initializer_range=0.1)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    teacher = jax.jit(init_params, static_argnums=0)(teacher_cfg, jax.random.key(7))
    config = load_run_config(None, [f"data.train={tmp_path / 'd.jsonl'}", "data.max_seq_len=64",
                                    "train.objective=distill", "train.batch_size=2", "train.grad_accum=2",
                                    "train.seed=3", f"distill.teacher={teacher_dir}", "distill.alpha=1.0",
                                    "distill.beta=0.5", "distill.seq_kd=true", "distill.max_new_tokens=6"])
    section = config.section("distill")
    tok = Tokenizer.byte_level()
    data = DISTILL.prepare(ObjectiveInputs(config, section, cfg, tok, log=lambda _: None))
    assert data.start is not None
    data.start(None, None, teacher)  # the trainer, once the weights are loaded

    def student():
        raise AssertionError("a seq_kd batch asked for the student's parameters")

    batch = data.batch(0, 1, student)
    assert batch["input_ids"].shape[:2] == (2, 2) and np.all(batch["on_policy"] == 0)
    draw = np.random.default_rng([3, 0, 1])
    draw.random()  # the on-policy draw, lost
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.9, seed=int(draw.integers(2**31)))
    rows = {k: v.reshape(4, -1) for k, v in batch.items() if v.ndim == 3}
    starts = [int(np.argmax(rows["loss_mask"][r] > 0)) for r in range(4)]
    prompts = [list(rows["input_ids"][r, :starts[r] + 1]) for r in range(4)]
    assert all(p in [prompt_of(e) for e in load_sft_examples(tmp_path / "d.jsonl", tok, 64)[0]] for p in prompts)
    completions = generate(teacher, teacher_cfg, prompts, sampling, eos_ids=[tok.eos_id], include_stop=True)
    assert completions != generate(params, cfg, prompts, sampling, eos_ids=[tok.eos_id],
                                   include_stop=True)  # the teacher's, not the student's
    for r, completion in enumerate(completions):
        assert rows["loss_mask"][r, :starts[r]].sum() == 0 and rows["loss_mask"][r].sum() == len(completion)
        assert list(rows["labels"][r, starts[r]:starts[r] + len(completion)]) == completion

    ctx = Context(cfg, None, ForwardOptions(), section, teacher_cfg)
    trainable, frozen = partition(params, trainable_mask(params, method_config("full")))
    kl, count = 0.0, 0.0
    for a in range(2):
        loss, (n, sums) = DISTILL.loss_terms(ctx)(trainable, frozen, teacher, {k: v[a] for k, v in batch.items()})
        kl, count = kl + float(sums["kl"]), count + float(n)
        np.testing.assert_allclose(float(loss), float(sums["kl"]), rtol=1e-6)  # alpha = 1
    # TRL's inputs: the rows as input_ids, labels the ids where a completion token is (-100 elsewhere), shifted there
    labels = np.where(np.roll(rows["loss_mask"], 1, axis=1) > 0, rows["input_ids"], -100)
    trl = gkd.GKDTrainer.generalized_jsd_loss(torch.tensor(_logits(params, cfg, rows)[:, :-1]),
                                              torch.tensor(_logits(teacher, teacher_cfg, rows)[:, :-1]),
                                              torch.tensor(labels[:, 1:]), beta=0.5)
    assert count == sum(len(c) for c in completions)
    np.testing.assert_allclose(kl / count, trl.item(), rtol=1e-5, atol=1e-6)


@pytest.mark.reference
@pytest.mark.parametrize("lmbda, seq_kd", [(0.5, True), (0.5, False), (0.25, True), (0.0, True)])
def test_draw_between_student_teacher_and_dataset_is_trls(tmp_path, monkeypatch, lmbda, seq_kd):
    """The branch each step takes (the student's samples, the teacher's, the dataset's) is the one TRL 1.16's
    `GKDTrainer.training_step` takes when its `random.random()` returns the step's draw: TRL's own method, run on
    a trainer with only lmbda, seq_kd and two stand-in models, records which model it decodes with."""
    gkd_trainer = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    cfg = tiny_config(vocab_size=259)
    section = DistillConfig(teacher="t", alpha=1.0, lmbda=lmbda, seq_kd=seq_kd, max_new_tokens=4)
    setup, train = _gkd_setup(tmp_path, section, cfg)
    student, teacher = {"student": np.zeros(())}, {"teacher": np.zeros(())}
    ours: list[str] = []

    def decoding(params, model_cfg, prompts, group_size, sampling, keys, **_):
        ours.append(next(iter(params)))
        return [[5]] * len(prompts)

    def dataset(epoch, index, _params):
        ours.append("dataset")
        return {"loss_mask": np.zeros((2, 2, 64), np.float32)}

    monkeypatch.setattr(distill, "sampled_groups", decoding)
    batch = mixed_batches(setup, train, dataset, teacher=(lambda: teacher, cfg) if seq_kd else None)
    kinds = [float(batch(0, i, lambda: student)["on_policy"].mean()) for i in range(16)]
    assert kinds == [float(k == "student") for k in ours]

    trls: list[str] = []
    trainer = object.__new__(gkd_trainer.GKDTrainer)
    trainer.__dict__.update(lmbda=lmbda, seq_kd=seq_kd, teacher_model="teacher", accelerator=None,
                            generation_kwargs={}, generation_config=None,
                            args=SimpleNamespace(gradient_checkpointing_kwargs=None),
                            generate_on_policy_outputs=lambda model, inputs, config: (trls.append(model),) * 3)
    draws = iter([np.random.default_rng([3, 0, i]).random() for i in range(16)])  # each step's first draw
    monkeypatch.setattr(gkd_trainer.random, "random", lambda: next(draws))
    monkeypatch.setattr(gkd_trainer, "unwrap_model_for_generation", lambda model, *a, **k: nullcontext(model))
    monkeypatch.setattr(gkd_trainer.SFTTrainer, "training_step", lambda self, model, inputs, n=None: None)
    for _ in range(16):
        before = len(trls)
        gkd_trainer.GKDTrainer.training_step(trainer, "student", {})
        trls += [] if len(trls) > before else ["dataset"]
    assert ours == trls and len(set(ours)) == 1 + (lmbda > 0), (ours, trls)


def test_offloaded_frozen_weights_are_refused_only_when_the_student_samples(tmp_path):
    """The student decodes from the frozen weights, which `[offload] frozen_params` keeps in host memory; the teacher
    (seq_kd alone) decodes from its own, which are never offloaded. Prompts that leave no room, or a decoder whose
    context the longest prompt and max_new_tokens pass, are one line when the batches are set up."""
    cfg, offload = tiny_config(vocab_size=259), OffloadConfig(frozen_params=True)
    teacher = (lambda: {}, cfg)
    setup, train = _gkd_setup(tmp_path, DistillConfig(teacher="t", seq_kd=True, max_new_tokens=6), cfg, offload)
    mixed_batches(setup, train, off_policy=None, teacher=teacher)
    setup, train = _gkd_setup(tmp_path, DistillConfig(teacher="t", alpha=1.0, lmbda=0.5, seq_kd=True), cfg,
                               offload)
    with pytest.raises(JaxtuneError, match=re.escape("[offload] frozen_params = true is not supported with [distill] "
                                                     "lmbda > 0 (the student decodes from the frozen weights)")):
        mixed_batches(setup, train, off_policy=None, teacher=teacher)
    setup, train = _gkd_setup(tmp_path, DistillConfig(teacher="t", seq_kd=True, max_new_tokens=64), cfg)
    with pytest.raises(JaxtuneError, match=re.escape("[distill] seq_kd = true: no training prompt leaves room for "
                                                     "max_new_tokens = 64 in [data] max_seq_len = 64")):
        mixed_batches(setup, train, off_policy=None, teacher=teacher)
    setup, train = _gkd_setup(tmp_path, DistillConfig(teacher="t", seq_kd=True, max_new_tokens=6), cfg)
    short = (lambda: {}, replace(cfg, max_position_embeddings=16))
    with pytest.raises(JaxtuneError, match=r"\[distill\] max_new_tokens = 6 after a prompt of \d+ tokens passes the "
                                           r"teacher's context of 16 \(max_position_embeddings\)"):
        mixed_batches(setup, train, off_policy=None, teacher=short)


def test_distill_config_keys():
    """reverse = true is beta = 1 (the key before beta); bad values and on-policy with a cross-entropy are one-line
    ConfigErrors; the planner counts the rollout only when the student samples."""
    assert DistillConfig(reverse=True).beta == 1.0 == DistillConfig(reverse=True, beta=1.0).beta
    assert DistillConfig().beta == 0.0
    for bad, message in [(dict(reverse=True, beta=0.5), "reverse = true: is beta = 1"),
                         (dict(beta=1.5), "beta = 1.5: must be in [0, 1]"),
                         (dict(lmbda=-0.1), "lmbda = -0.1: must be in [0, 1]"),
                         (dict(lmbda=0.5), "alpha = 0.5: must be 1 with lmbda = 0.5"),
                         (dict(alpha=1.0, lmbda=1.0, max_new_tokens=0), "max_new_tokens = 0: must be >= 1"),
                         (dict(sampling_temperature=0.0), "sampling_temperature = 0.0: must be > 0"),
                         (dict(alpha=1.0, lmbda=1.0, seq_kd=True), "seq_kd = true: is never used with lmbda = 1")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            DistillConfig(**bad)
    assert DISTILL.rollout_tokens(DistillConfig()) == 0
    assert DISTILL.rollout_tokens(DistillConfig(alpha=1.0, lmbda=0.25, max_new_tokens=16)) == 16
    assert DISTILL.rollout_tokens(DistillConfig(seq_kd=True, max_new_tokens=16)) == 16  # the teacher decodes
