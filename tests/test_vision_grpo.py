"""GRPO and RLOO with image prompts (issue 52): TRL's prompt records with images, rollouts conditioned on them
(`rollouts.image_prompts`: left-padded, prefilled by the family), the step's log-probs reading them. Everyday: the
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


@pytest.mark.full
def test_rollouts_with_images_decode_each_prompt_as_alone(tmp_path):
    """`sampled_groups` of prompts with images (two pictures, none; left-padded together, each twice), greedy:
    every row's tokens are those of its prompt decoded alone by `generate_ids_with_images` (itself transformers'
    `generate`'s, tests/test_vision_train.py). The paged engine refuses image prompts in one line."""
    from jaxtune.config import SamplingConfig
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.rollout_config import GRPOConfig
    from jaxtune.presets import write_random_vision_model
    from jaxtune.rollouts.decoders import sampled_groups
    from jaxtune.rollouts.image_prompts import PromptImages

    model = write_random_vision_model(tmp_path / "m", seed=3)
    generator = load_image_generator(model)
    prompts = [prompt_ids(generator.processor, "Which?", [_picture(0), _picture(1)]),
               prompt_ids(generator.processor, "No picture, a longer prompt", [])]
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    eos = list(generator.cfg.eos_token_id)
    images = PromptImages.of(image_side(model, 2), [type("P", (), {"pixel_values": p})() for _, p in prompts])
    params = {**generator.params, "vision": generator.vision_params}
    sample = lambda engine: sampled_groups(params, generator.cfg, [ids for ids, _ in prompts], 2, sampling,
                                           GRPOConfig(reward=("r",), rollout_engine=engine), eos_ids=eos, method=None,
                                           images=images)
    with pytest.raises(JaxtuneError, match=r'^rollout_engine = "paged" does not take prompts with images yet'):
        sample("paged")
    alone = [generate_ids_with_images(generator, ids, pixels, sampling, eos) for ids, pixels in prompts]
    assert sample("padded") == [r for r in alone for _ in range(2)] and alone[0] != alone[1]
