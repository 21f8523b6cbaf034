"""GRPO and RLOO with image prompts (issue 52): TRL's prompt records with images, rollouts conditioned on them
(`image_decoding`: left-padded, prefilled by the family), the step's log-probs reading them. Everyday: the
records' ids and pixels; batched rollouts equal each prompt decoded alone (Gemma 3). Full tier: greedy rollouts
equal transformers' `generate` (Gemma 3, Qwen2.5-VL); a GRPO step's loss and LoRA gradients on fixed completions
equal a torch computation on transformers' model; `fine_tune` GRPO and RLOO runs on image prompts."""

import json

import numpy as np
import pytest
from PIL import Image

from jaxtune.data.image_prompts import image_prompt_examples
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.families import image_processor
from jaxtune.presets import GEMMA3_IMAGE, write_gemma3_files

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230)}


def _picture(seed: int, size=(40, 30)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def write_prompts(root, records: list[dict]) -> str:
    """`records` as root/prompts.jsonl, beside the colour pictures they name."""
    for name, rgb in COLOURS.items():
        Image.new("RGB", (40, 30), rgb).save(root / f"{name}.png")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(root / "prompts.jsonl")


TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}, {"type": "image"}]}]


def colour_prompts(n: int) -> list[dict]:
    """n prompt records in TRL's format, one picture each (a string user turn: the image goes before its text)."""
    names = list(COLOURS)
    return [{"prompt": [{"role": "user", "content": "Colour?"}], "image": f"{names[i % 3]}.png",
             "answer": names[i % 3]} for i in range(n)]


def test_image_prompts_in_trls_format(tmp_path):
    """A string user turn takes the record's "image" before its text (TRL's `prepare_multimodal_messages`); image
    parts take "images" in order; the ids are those `generate --image` prefills; a text prompt is encoded as text
    GRPO encodes it; the other fields stay for the rewards; bad records are one line naming FILE:LINE."""
    from jaxtune.image_generation import prompt_ids

    model = write_gemma3_files(tmp_path / "model")
    tokenizer = load_tokenizer(model)
    processor = image_processor(model, tokenizer)
    path = write_prompts(tmp_path, [*colour_prompts(1), {"prompt": TWO, "images": ["green.png", "blue.png"]},
                                    {"prompt": "Plain text", "answer": "x"}])
    one, two, text = image_prompt_examples(path, tokenizer, processor, 2)
    pictures = {name: Image.open(tmp_path / f"{name}.png") for name in COLOURS}
    assert one.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    assert one.fields == {"image": "red.png", "answer": "red"} and one.pixel_values.shape == (1, 3, 64, 64)
    ids, pixels = prompt_ids(processor, one.prompt, [pictures["red"]])
    assert list(one.ids) == ids and np.array_equal(one.pixel_values, pixels)
    ids, pixels = prompt_ids(processor, TWO, [pictures["green"], pictures["blue"]])
    assert list(two.ids) == ids and np.array_equal(two.pixel_values, pixels) and ids.count(GEMMA3_IMAGE) == 8
    assert list(text.ids) == tokenizer.encode("Plain text") and text.pixel_values.shape == (0, 3, 64, 64)
    with pytest.raises(JaxtuneError, match=r"prompts.jsonl:2: the prompt's images make 2 pixel arrays; \[data\] "
                                           r"max_images_per_row = 1 must be at least that"):
        image_prompt_examples(path, tokenizer, processor, 1)
    write_prompts(tmp_path, [{"prompt": "Colour?", "image": "red.png"}])
    with pytest.raises(JaxtuneError, match=r"prompts.jsonl:1: images need a conversational prompt"):
        image_prompt_examples(path, tokenizer, processor, 2)


@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_planner_counts_the_image_side_of_grpo_and_rloo(tmp_path, objective):
    """A GRPO or RLOO run config on a Gemma 3 VLM plans what it runs: the image side (the tower's weights among the
    frozen ones, its forward a moment of its own) and each rollout row's pixel arrays in the step's micro-batch,
    beside the rollout's KV cache."""
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives import objective_named
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device
    from jaxtune.spine.run import train_plan

    cfg = load_config(write_gemma3_files(tmp_path / "model"))  # `plan --config`'s plan, without the weights
    plan = train_plan(_run_config(tmp_path, objective, 1), "float32")
    assert plan.images == image_side(tmp_path / "model", 1) and plan.generate_tokens == 6
    micro = objective_named(objective).micro_batch(4, 64, plan.section, plan.images)
    assert micro["pixel_values"].shape == (4, 1, 3, 64, 64) and micro["advantages"].shape == (4,)
    planned = estimate(cfg, plan, get_device("h100"))
    assert planned.phases["image side"]["activations"] > 0 and planned.phases["generate"]["activations"] > 0
    text_only = estimate(cfg, plan.replace(images=None), get_device("h100"))
    assert planned.frozen_bytes > text_only.frozen_bytes and "image side" not in text_only.phases


@pytest.mark.full
def test_rollouts_with_images_decode_each_prompt_as_alone(tmp_path):
    """`sampled_groups` of prompts with images (two pictures, none; left-padded together, each twice), greedy:
    every row's tokens are those of its prompt decoded alone by `generate_ids_with_images` (itself transformers'
    `generate`'s, tests/test_vision_train.py). The paged engine refuses image prompts in one line."""
    from jaxtune.config import SamplingConfig
    from jaxtune.image_decoding import PromptImages
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.rollout_config import GRPOConfig
    from jaxtune.presets import write_random_vision_model
    from jaxtune.rollouts.decoders import sampled_groups

    model = write_random_vision_model(tmp_path / "m", seed=3)
    generator = load_image_generator(model)
    prompts = [prompt_ids(generator.processor, "Which?", [_picture(0), _picture(1)]),
               prompt_ids(generator.processor, "No picture, a longer prompt", [])]
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    eos = list(generator.cfg.eos_token_id)
    images = PromptImages.of(image_side(model, 2), [p for _, p in prompts])
    params = {**generator.params, "vision": generator.vision_params}
    sample = lambda engine: sampled_groups(params, generator.cfg, [ids for ids, _ in prompts], 2, sampling,
                                           GRPOConfig(reward=("r",), rollout_engine=engine), eos_ids=eos, method=None,
                                           images=images)
    with pytest.raises(JaxtuneError, match=r'^rollout_engine = "paged" does not take prompts with images yet'):
        sample("paged")
    alone = [generate_ids_with_images(generator, ids, pixels, sampling, eos) for ids, pixels in prompts]
    assert sample("padded") == [r for r in alone for _ in range(2)] and alone[0] != alone[1]


def _gemma3(directory):
    """test_vision_gemma3's tiny Gemma3ForConditionalGeneration (float32) with the preset's tokenizer."""
    from test_vision_train import gemma3_run_dir

    return gemma3_run_dir(directory)


def _qwen2_5_vl(directory):
    """A tiny random Qwen2_5_VLForConditionalGeneration (tests/qwen_vl_files.py's shapes), saved with its files."""
    import torch
    import transformers
    from hf_models import randomize
    from qwen_vl_files import QWEN_IMAGE, QWEN_TEXT, QWEN_VISION, write_qwen_vl_files

    config = transformers.Qwen2_5_VLConfig(
        text_config={**QWEN_TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                      "rope_theta": 1e4}},
        vision_config=QWEN_VISION, image_token_id=QWEN_IMAGE, video_token_id=91, vision_start_token_id=92,
        vision_end_token_id=93)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen2_5_VLForConditionalGeneration(config), 0)
    model.save_pretrained(directory)
    write_qwen_vl_files(directory, config=False)
    return model.eval()


def _hf_inputs(family: str, ids, pixels) -> dict:
    """transformers' keyword arguments for a prompt's ids [1, T] and its pixel arrays [N, ...]."""
    import torch
    from test_vision_qwen_vl_train import _hf_inputs as qwen_inputs

    from jaxtune.data.image_examples import ImageExample

    if family == "qwen2_5_vl":
        return qwen_inputs(ImageExample(tuple(ids), (0,) * len(ids), pixels))
    tokens = torch.tensor([list(ids)])
    if not len(pixels):
        return dict(input_ids=tokens)
    return dict(input_ids=tokens, pixel_values=torch.tensor(pixels), token_type_ids=(tokens == GEMMA3_IMAGE).long())


FAMILIES = {"gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl}
SIZES = [(40, 30), (20, 52), (64, 64)]


def _prompts(root, model_dir):
    """Three prompts of TRL's format read for the model: two pictures, one, none (different lengths)."""
    for i, size in enumerate(SIZES):
        _picture(i, size).save(root / f"p{i}.png")
    records = [{"prompt": TWO, "images": ["p0.png", "p1.png"], "answer": "a"},
               {"prompt": [{"role": "user", "content": "Colour of this one?"}], "image": "p2.png", "answer": "b"},
               {"prompt": [{"role": "user", "content": "No picture here"}], "answer": "c"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = load_tokenizer(model_dir)
    return image_prompt_examples(root / "prompts.jsonl", tokenizer, image_processor(model_dir, tokenizer), 2)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_rollouts_with_images_equal_transformers_generate(tmp_path, family):
    """GRPO's rollouts (`sampled_groups`, the prompts left-padded together, each twice) of prompts with images,
    greedy, 10 tokens: each row equals transformers' `generate` of its prompt (Qwen2.5-VL: decoding on from the
    M-RoPE prompt's largest position + 1, transformers' rope deltas)."""
    import torch

    from jaxtune.config import SamplingConfig
    from jaxtune.image_decoding import PromptImages
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.rollout_config import GRPOConfig
    from jaxtune.rollouts.decoders import sampled_groups
    from jaxtune.spine.model import load_vision_language_model

    model = FAMILIES[family](tmp_path / "model")
    prompts = _prompts(tmp_path, tmp_path / "model")
    cfg, params, _, vision_params = load_vision_language_model(tmp_path / "model")
    rows = sampled_groups({**params, "vision": vision_params}, cfg, [list(p.ids) for p in prompts], 2,
                          SamplingConfig(max_new_tokens=10, temperature=0.0), GRPOConfig(reward=("r",)), eos_ids=[],
                          method=None, images=PromptImages.of(image_side(tmp_path / "model", 2),
                                                              [p.pixel_values for p in prompts]))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(**_hf_inputs(family, prompt.ids, prompt.pixel_values), do_sample=False,
                                 max_new_tokens=10, min_new_tokens=10, pad_token_id=0, eos_token_id=None)
        assert rows[2 * i] == rows[2 * i + 1] == out[0, len(prompt.ids):].tolist(), i


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("family", list(FAMILIES))
def test_grpo_step_with_images_equals_torch_on_transformers(tmp_path, family):
    """One GRPO step's loss terms on fixed completions of prompts with images (LoRA policy, the base with it off as
    the reference, temperature 0.7, KL 0.1, TRL's default loss_type "dapo"): the loss and d(loss)/d(LoRA A, B) equal
    TRL's per-token loss computed in torch on the PEFT-wrapped transformers model with the same images."""
    import jax
    import torch
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft

    from jaxtune.config import ForwardOptions
    from jaxtune.image_decoding import PromptImages
    from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter
    from jaxtune.methods.transform import combine, partition, trainable_mask
    from jaxtune.models.vision.families import image_side, vision_family
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.grpo import GRPO, rollout_batch
    from jaxtune.objectives.rollout_config import GRPOConfig
    from jaxtune.spine.model import load_vision_language_model

    directory = tmp_path / "model"
    model = FAMILIES[family](directory)
    outside = vision_family(directory).outside_text
    peft_model = randomize_peft(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 exclude_modules=outside)))
    peft_model.save_pretrained(tmp_path / "adapter")
    prompts = _prompts(tmp_path, directory)
    cfg, params, _, vision_params = load_vision_language_model(directory)
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    section = GRPOConfig(reward=("r",), group_size=2, temperature=0.7, kl_coef=0.1)
    completions = [[5, 9, 12, 1], [7, 7], [20, 21, 22, 23, 24], [2], [30, 1], [11, 13, 17]]
    rows = [list(p.ids) for p in prompts for _ in range(2)]
    advantages = np.float32([0.5, -0.5, 1.0, -1.0, 0.3, -0.3])
    batch = rollout_batch(rows, completions, np.zeros(6), advantages, 256)
    assert batch["loss_mask"].sum() == sum(map(len, completions))  # nothing cut
    images = PromptImages.of(image_side(directory, 2), [p.pixel_values for p in prompts])
    batch["pixel_values"] = np.repeat(images.pixels, 2, axis=0)
    policy = {**with_adapter, "vision": vision_params}
    trainable, frozen = partition(policy, trainable_mask(policy, method))
    terms = GRPO.loss_terms(Context(cfg, method, ForwardOptions(), section, images=images.side))

    def loss(t):
        total, (count, _) = terms(t, frozen, None, {k: jax.numpy.asarray(v) for k, v in batch.items()})
        return total / count

    ours, grads = jax.value_and_grad(loss)(trainable)

    def token_logps(prompt, completion):
        ids = list(prompt.ids) + completion
        logits = peft_model(**_hf_inputs(family, ids, prompt.pixel_values)).logits[0, :-1] / section.temperature
        logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return logps[len(prompt.ids) - 1:]

    per_token = []
    for row, completion in enumerate(completions):
        prompt = prompts[row // 2]
        logp = token_logps(prompt, completion)
        with torch.no_grad(), peft_model.disable_adapter():
            ref = token_logps(prompt, completion)
        ratio = torch.exp(logp - logp.detach())
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token.append(-ratio * float(advantages[row]) + section.kl_coef * kl)
    want = torch.cat(per_token).sum() / sum(len(c) for c in completions)
    want.backward()
    np.testing.assert_allclose(float(ours), float(want), rtol=1e-5, atol=1e-6)
    theirs = {name.replace(".default", "").replace(".model.language_model.", ".model."): p.grad.numpy()
              for name, p in peft_model.named_parameters() if p.requires_grad}
    mine = adapter_state_dict(combine(grads, frozen), cfg, method)
    assert set(mine) == set(theirs) and len(mine) == 4 * cfg.num_layers
    for name, grad in theirs.items():
        assert np.abs(mine[name] - grad).max() <= 1e-4 * np.abs(grad).max(), name


def colour_reward(prompts, completions, answer, image):
    """A text reward, as TRL calls it (the record's other fields as keyword lists, "image" among them): the share of
    the completion's characters in the answer's, for prompts that are conversations holding one image part."""
    assert all(p[0]["content"][0] == {"type": "image"} for p in prompts) and len(image) == len(prompts)
    return [sum(ch in a for ch in c) / max(len(c), 1) for c, a in zip(completions, answer)]


def _run_config(root, objective: str, steps: int, *section: str):
    """A TOML run of `objective` (grpo or rloo), LoRA on q_proj and v_proj of root/model, on root/prompts.jsonl with
    `colour_reward`; `section`: more lines of the objective's section."""
    from jaxtune.run_config import load_run_config

    text = "\n".join(["[model]", f'path = "{root / "model"}"', 'dtype = "float32"', "[method]", 'kind = "lora"',
                      "rank = 4", 'target_modules = ["q_proj", "v_proj"]', "[data]",
                      f'train = "{root / "prompts.jsonl"}"', "max_seq_len = 64", "eval_fraction = 0.25",
                      "max_images_per_row = 1", "[train]", f'objective = "{objective}"',
                      f'output_dir = "{root / objective}"', f"max_steps = {steps}", "batch_size = 2",
                      "learning_rate = 1e-2", "log_every = 1", f"eval_every = {steps}", f"[{objective}]",
                      'reward = ["test_vision_grpo.colour_reward"]', "group_size = 2", "max_new_tokens = 6", *section])
    (root / f"{objective}.toml").write_text(text + "\n")
    return load_run_config(root / f"{objective}.toml")


@pytest.mark.full
@pytest.mark.reference
def test_grpo_and_rloo_runs_on_image_prompts(tmp_path):
    """`fine_tune` on a Gemma 3 VLM directory (`presets.write_random_vision_model`) with TRL's prompt records, one
    picture each, and a text reward: GRPO runs 2 steps (rollouts, rewards, steps and the held-out greedy reward all
    with the images), RLOO 1 step through the same path; a run of the paged engine is refused in one line."""
    from jaxtune.presets import write_random_vision_model
    from jaxtune.train.loop import fine_tune

    write_random_vision_model(tmp_path / "model", seed=2)
    write_prompts(tmp_path, colour_prompts(8))
    logs: list[str] = []
    grpo = fine_tune(_run_config(tmp_path, "grpo", 2), log=logs.append)
    metrics = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert grpo.step == 2 and np.isfinite(grpo.train_loss)
    assert [m["step"] for m in metrics if "reward" in m] == [1, 2]
    assert any("eval_reward" in m for m in metrics)
    assert any("data: 6 train / 2 eval prompts" in line for line in logs)
    rloo = fine_tune(_run_config(tmp_path, "rloo", 1), log=lambda _: None)
    assert rloo.step == 1 and np.isfinite(rloo.train_loss)
    with pytest.raises(JaxtuneError, match=r'^\[grpo\] rollout_engine = "paged" does not take a vision-language '):
        fine_tune(_run_config(tmp_path, "grpo", 1, 'rollout_engine = "paged"'), log=lambda _: None)
