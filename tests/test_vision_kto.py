"""KTO with images (issue 52): TRL's vision records {prompt, completion, label, images} (and pairs, unpaired) read as
`image_labelled_examples`; every row of a KTO batch carries its prompt's pixel arrays, the mismatched KL rows
(prompt_i + completion_(i-1)) prompt_i's, as TRL's `DataCollatorForVisionUnpairedPreference` builds them; the
planner counts the image side. Full tier, on a tiny Gemma3ForConditionalGeneration (and Qwen2.5-VL's in
test_vision_qwen_vl_train.py): the KTO loss (policy: a random LoRA adapter, reference: the base with it off) equals
TRL's `_compute_loss` formula on transformers' log-probs of the same rows and images; one `fine_tune` step runs."""

import json

import numpy as np
import pytest
from PIL import Image

from jaxtune.data.batching import ImageRows
from jaxtune.data.image_examples import image_labelled_examples
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.families import image_processor
from jaxtune.objectives.kto import kto_batch
from jaxtune.presets import GEMMA3_IMAGE, write_gemma3_files

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230)}
ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Both?"}, {"type": "image"}]}]


def write_labelled_data(root, records: list[dict] | None = None) -> str:
    """`records` (default: TRL's unpaired vision records about the colour pictures, and one pair) as
    root/kto.jsonl, beside the pictures."""
    for name, rgb in COLOURS.items():
        Image.new("RGB", (40, 30), rgb).save(root / f"{name}.png")
    records = records or [
        {"prompt": ASK, "completion": "Red.", "label": True, "images": ["red.png"]},
        {"prompt": TWO, "completion": [{"role": "assistant", "content": "Blue, red."}], "label": False,
         "images": ["green.png", "blue.png"]},
        {"prompt": ASK, "chosen": "Blue.", "rejected": "Green!", "images": ["blue.png"]},
        {"prompt": ASK, "completion": "Green.", "label": True, "images": ["green.png"]},
        {"prompt": ASK, "completion": "Red!", "label": False, "images": ["blue.png"]}]
    (root / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(root / "kto.jsonl")


def test_kto_rows_and_their_mismatched_rows_carry_their_prompts_images(tmp_path):
    """Unpaired records and a pair (two examples) with one or two images: each example its prompt's pixel arrays
    and label; in a batch, row i and its KL row B + i (prompt_i + completion_(i-1)) hold example i's pixel arrays,
    padding rows none; too many images a row and a non-boolean label are one line each."""
    model = write_gemma3_files(tmp_path / "model")
    tokenizer = load_tokenizer(model)
    processor = image_processor(model, tokenizer)
    examples = list(image_labelled_examples(write_labelled_data(tmp_path), tokenizer, processor, 64))
    assert [(e.label[0], e.images) for e in examples] == [(1, 1), (0, 2), (1, 1), (0, 1), (1, 1), (0, 1)]
    assert [tokenizer.decode(list(e.completion), skip_special_tokens=False) for e in examples[:4]] == [
        "Red.<end_of_turn>", "Blue, red.<end_of_turn>", "Blue.<end_of_turn>", "Green!<end_of_turn>"]
    assert all(list(e.prompt).count(GEMMA3_IMAGE) == 4 * e.images for e in examples)
    assert examples[2].prompt == examples[3].prompt and examples[2].pixel_values is examples[3].pixel_values

    three = examples[:3]
    batch = kto_batch(three, 4, 64, True, ImageRows(2, processor.pixel_shape))
    assert batch["pixel_values"].shape == (8, 2, 3, 64, 64)
    for i, e in enumerate(three):
        for row in (i, 4 + i):
            np.testing.assert_array_equal(batch["pixel_values"][row, :e.images], e.pixel_values)
            assert not batch["pixel_values"][row, e.images:].any()
        mismatched = e.prompt + three[i - 1].completion
        assert batch["input_ids"][4 + i, :len(mismatched) - 1].tolist() == list(mismatched[:-1])
    assert not batch["pixel_values"][[3, 7]].any() and batch["desirable"].tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    assert kto_batch(examples[:2], 2, 64, False, ImageRows(2, processor.pixel_shape))["pixel_values"].shape[0] == 2
    with pytest.raises(JaxtuneError, match="holds 2 pixel arrays; .*max_images_per_row = 1 must be at least that"):
        kto_batch(examples[:2], 2, 64, True, ImageRows(1, processor.pixel_shape))
    path = write_labelled_data(tmp_path, [{"prompt": ASK, "completion": "Red.", "label": "yes", "images": ["red.png"]}])
    with pytest.raises(JaxtuneError, match=r"^.*kto.jsonl:1: unpaired field 'label' must be true or false, got 'yes'$"):
        list(image_labelled_examples(path, tokenizer, processor, 64))


def _run_config(root, steps: int = 1, batch_size: int = 2):
    """A LoRA KTO run on root/model and root/kto.jsonl, one image a row."""
    from jaxtune.run_config import load_run_config

    text = "\n".join(["[model]", f'path = "{root / "model"}"', 'dtype = "float32"', "[method]", 'kind = "lora"',
                      "rank = 4", 'target_modules = ["q_proj", "v_proj"]', "[data]", f'train = "{root / "kto.jsonl"}"',
                      "max_seq_len = 64", "eval_fraction = 0.0", "max_images_per_row = 2", "[train]",
                      'objective = "kto"', f'output_dir = "{root / "kto"}"', f"max_steps = {steps}",
                      f"batch_size = {batch_size}", "learning_rate = 1e-2", "log_every = 1", "eval_every = 0",
                      "[kto]", "beta = 0.5"])
    (root / "kto.toml").write_text(text + "\n")
    return load_run_config(root / "kto.toml")


def test_planner_counts_the_image_side_of_kto(tmp_path):
    """A KTO run config on a Gemma 3 VLM plans what it runs: 2B rows (each example and its KL row), each with its
    pixel arrays, and the image side (the tower's weights among the frozen ones, its forward a moment of its own)."""
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives import objective_named
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device
    from jaxtune.spine.run import train_plan

    cfg = load_config(write_gemma3_files(tmp_path / "model"))  # `plan --config`'s plan, without the weights
    plan = train_plan(_run_config(tmp_path), "float32")
    assert plan.images == image_side(tmp_path / "model", 2)
    micro = objective_named("kto").micro_batch(4, 64, plan.section, plan.images)
    assert micro["pixel_values"].shape == (4, 2, 3, 64, 64) and micro["desirable"].shape == (4,)
    planned = estimate(cfg, plan, get_device("h100"))
    assert planned.phases["image side"]["activations"] > 0
    text_only = estimate(cfg, plan.replace(images=None), get_device("h100"))
    assert planned.frozen_bytes > text_only.frozen_bytes and "image side" not in text_only.phases


def kto_against_trl(root, model, forward, outside_text: str, seq_len: int, seed: int) -> tuple[float, float]:
    """(jaxtune's KTO loss of a batch of 3 examples with images (desirable, not, desirable) and their KL rows, TRL's
    `KTOTrainer._compute_loss` formula on transformers' log-probs of the same rows): z0 = the mean KL-row log-ratio
    clamped at 0 (asserted > 0); 1 - sigmoid(beta (r - z0)) desirable, 1 - sigmoid(beta (z0 - r)) undesirable; the
    mean. Policy: a random LoRA (torch seed `seed`) on a copy of `model` (PEFT, `outside_text` excluded), reference:
    its base with the adapter off; every row reads its prompt's images. root/model: the model's directory;
    forward(model, ids, pixel arrays) -> logits [1, n, V]."""
    import copy

    import jax
    import torch
    from peft import LoraConfig, get_peft_model

    from jaxtune.config import ForwardOptions
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.base import Context, strip_adapters
    from jaxtune.objectives.kto import KTOConfig, _sums
    from jaxtune.spine.model import load_vision_language_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=outside_text,
                      init_lora_weights=False)  # B random: the policy differs from its reference
    peft_model = get_peft_model(copy.deepcopy(model), lora).eval()
    peft_model.save_pretrained(root / "kto_adapter")
    tokenizer = load_tokenizer(root / "model")
    processor = image_processor(root / "model", tokenizer)
    examples = list(image_labelled_examples(write_labelled_data(root), tokenizer, processor, seq_len))[:3]
    batch = kto_batch(examples, 3, seq_len, True, ImageRows(2, processor.pixel_shape))
    cfg, params, _, vision_params = load_vision_language_model(root / "model")
    method, policy = load_peft_adapter(root / "kto_adapter", params, cfg)
    section = KTOConfig(beta=0.5)
    ctx = Context(cfg, method, ForwardOptions(), section, images=image_side(root / "model", 2))
    policy = {**policy, "vision": vision_params}
    loss, count, _ = jax.jit(_sums, static_argnums=3)(policy, strip_adapters(policy), batch, ctx)
    assert float(count) == 3

    def logp(prompt, completion, pixels):
        ids = prompt + completion
        logits = forward(peft_model, ids, pixels)
        logps = torch.log_softmax(logits[0, :-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return logps[len(prompt) - 1:].sum()

    def logps(completions):  # (policy, reference) log-probs [3] of prompt_i + completions[i], prompt_i's images
        rows = [(e.prompt, c, e.pixel_values) for e, c in zip(examples, completions)]
        policy = torch.stack([logp(*r) for r in rows])
        with peft_model.disable_adapter():
            return policy, torch.stack([logp(*r) for r in rows])

    with torch.no_grad():
        own, own_ref = logps([e.completion for e in examples])
        kl, kl_ref = logps([examples[i - 1].completion for i in range(3)])  # TRL's completions[-1:] + [:-1]
    z0 = (kl - kl_ref).mean().clamp(min=0)
    ratio = own - own_ref
    desirable = torch.tensor([e.label[0] == 1 for e in examples])
    losses = torch.cat([1 - torch.sigmoid(section.beta * (ratio[desirable] - z0)),
                        1 - torch.sigmoid(section.beta * (z0 - ratio[~desirable]))])
    assert float(z0) > 0 and desirable.tolist() == [True, False, True]
    return float(loss) / float(count), float(losses.mean())


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_kto_with_images_equals_trl_kto_loss_on_transformers_logps(tmp_path):
    """Gemma 3: `kto_against_trl`'s two losses agree (the check fails, 0.509 against 0.474, when the KL rows'
    pixel arrays are zeroed); one `fine_tune` step of objective kto on image records runs."""
    import torch
    from test_vision_train import gemma3_run_dir

    from jaxtune.models.vision.gemma3 import GEMMA3
    from jaxtune.train.loop import fine_tune

    def forward(model, ids, pixels):
        ids = torch.tensor([ids])
        return model(input_ids=ids, pixel_values=torch.tensor(pixels),
                     token_type_ids=(ids == GEMMA3_IMAGE).long()).logits

    ours, trl = kto_against_trl(tmp_path, gemma3_run_dir(tmp_path / "model"), forward, GEMMA3.outside_text, 64, 3)
    np.testing.assert_allclose(ours, trl, rtol=1e-4)

    result = fine_tune(_run_config(tmp_path), log=lambda _: None)
    assert result.step == 1 and np.isfinite(result.train_loss)
