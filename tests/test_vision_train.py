"""Fine-tuning Gemma 3 with images (issue 52): chat and conversational prompt / completion records with images become
ids exactly as transformers' Gemma3Processor writes them, the loss on the assistant's text only; cuts keep whole
images; rows packed with their images in a static [rows, max images, C, H, W]; the planner counts the image side.
Full tier, on a tiny Gemma3ForConditionalGeneration: a batch's loss equals transformers'; LoRA SFT through
`fine_tune` lowers the loss and resumes; the adapter loads in PEFT on the VLM, merged and full fine-tune exports
load in transformers, all with the same logits; greedy generation with images equals `generate`; DPO with images
equals the DPO formula on transformers' log-probabilities."""

import io
import json
import warnings

import numpy as np
import pytest
from PIL import Image

from jaxtune.data.formats import DataStats
from jaxtune.data.image_examples import image_example, image_sft_examples
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.families import image_processor
from jaxtune.presets import GEMMA3_BOI as BOI
from jaxtune.presets import GEMMA3_EOI as EOI
from jaxtune.presets import GEMMA3_IMAGE as IMAGE
from jaxtune.presets import write_gemma3_files

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red and blue."}]},
            {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Green."}]
TEXT_ONLY = [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Yo."}]


def _picture(seed: int, size=(40, 30)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def model_dir(tmp_path):
    return write_gemma3_files(tmp_path / "model")


def test_loss_only_on_the_assistant_text_never_on_images(model_dir):
    tokenizer = load_tokenizer(model_dir)
    processor = image_processor(model_dir, tokenizer)
    example = image_example(MESSAGES, [_picture(0), _picture(1)], processor, tokenizer)
    ids, mask = np.asarray(example.ids), np.asarray(example.loss_mask)
    assert example.pixel_values.shape == (2, 3, 64, 64) and (ids == IMAGE).sum() == 8
    assert ((ids == BOI).sum(), (ids == EOI).sum()) == (2, 2)
    trained = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "Red and blue.<end_of_turn>Green.<end_of_turn>"
    assert not mask[np.isin(ids, [IMAGE, BOI, EOI])].any()


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_ids_and_pixels_equal_gemma3_processor(tmp_path, pan_and_scan):
    """transformers' Gemma3Processor on the chat template's text (as TRL's vision collator calls it): the same ids,
    image tokens where its token_type_ids are 1, the same pixel values (a wide picture gets pan-and-scan crops)."""
    import transformers

    model_dir = write_gemma3_files(tmp_path, pan_and_scan)
    tokenizer = load_tokenizer(model_dir)
    images = [_picture(0, (60, 20)), _picture(1)]
    example = image_example(MESSAGES, images, image_processor(model_dir, tokenizer), tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    kwargs = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=2,
                  pan_and_scan_min_ratio_to_activate=1.5) if pan_and_scan else {}
    processor = transformers.Gemma3Processor(
        transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, **kwargs), hf_tokenizer,
        chat_template=hf_tokenizer.chat_template, image_seq_length=4)
    text = processor.apply_chat_template(MESSAGES, tokenize=False)
    want = processor(text=[text], images=[images], add_special_tokens=False, return_tensors="np", **kwargs)
    assert list(example.ids) == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.asarray(example.ids) == IMAGE, want["token_type_ids"][0] == 1)
    np.testing.assert_array_equal(example.pixel_values, want["pixel_values"])
    assert (example.pixel_values.shape[0] > 2) == pan_and_scan


def test_records_from_a_file_with_a_cut_and_a_missing_image(model_dir, tmp_path):
    """Chat and conversational prompt / completion records, images by path and bytes; a cut inside the second
    image's tokens keeps the first image only; a missing image is one line naming the file and line."""
    tokenizer = load_tokenizer(model_dir)
    processor = image_processor(model_dir, tokenizer)
    _picture(0).save(tmp_path / "a.png")
    records = [{"messages": MESSAGES, "images": ["a.png", {"bytes": _png(_picture(1))}]},
               {"prompt": [MESSAGES[0]], "completion": [MESSAGES[1]], "images": ["a.png", "a.png"]},
               {"prompt": "plain", "completion": " text"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r, default=lambda b: None) + "\n" for r in records).replace(
        '{"bytes": null}', json.dumps(str(tmp_path / "a.png"))))
    stats = DataStats()
    chat, pair, text = image_sft_examples(data, tokenizer, processor, 200, stats=stats)
    assert (chat.images, pair.images, text.images) == (2, 2, 0) and text.pixel_values.shape == (0, 3, 64, 64)
    assert stats.formats == {"chat": 1, "prompt/completion": 2}
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
             {"role": "assistant", "content": "Red."}, {"role": "user", "content": [{"type": "image"}]},
             {"role": "assistant", "content": "Green."}]
    two = image_example(turns, [_picture(0), _picture(1)], processor, tokenizer)
    second = int(np.flatnonzero(np.asarray(two.ids) == IMAGE)[5])  # inside the second image's run
    data.write_text(json.dumps({"messages": turns, "images": ["a.png", "a.png"]}) + "\n")
    cut, = image_sft_examples(data, tokenizer, processor, second)
    assert cut.images == 1 and (np.asarray(cut.ids) == IMAGE).sum() == 4 and len(cut.ids) == second - 1
    assert tokenizer.decode(np.asarray(cut.ids)[np.asarray(cut.loss_mask) == 1].tolist()) == "Red."
    data.write_text(json.dumps({"messages": MESSAGES, "images": ["a.png", "gone.png"]}) + "\n")
    with pytest.raises(JaxtuneError, match=r"^.*d.jsonl:1: images\[1\]: .*gone.png not found$"):
        list(image_sft_examples(data, tokenizer, processor, 200))


def test_rows_pack_within_max_images_and_carry_their_pixels(model_dir):
    """Three examples of 2, 1 and 0 images packed in rows of at most 2 pixel arrays: each row's pixel_values are
    its examples' arrays in the order of its placeholder runs, zeros after; more than max_images is one line."""
    from jaxtune.data.batching import ImageRows, epoch_batches

    tokenizer = load_tokenizer(model_dir)
    processor = image_processor(model_dir, tokenizer)
    short = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": "Yo."}]
    examples = [image_example(MESSAGES, [_picture(0), _picture(1)], processor, tokenizer),
                image_example(short, [_picture(2)], processor, tokenizer),
                image_example(TEXT_ONLY, [], processor, tokenizer)]
    batch, = epoch_batches(examples, 4, 200, 0, 0, images=ImageRows(2, processor.pixel_shape))
    assert batch["pixel_values"].shape == (4, 2, 3, 64, 64)
    by_pixels = {e.pixel_values[:1].tobytes(): e for e in examples[:2]}
    for row, pixels in zip(batch["input_ids"], batch["pixel_values"]):
        runs = int(np.sum(np.diff(np.concatenate([[0], row == IMAGE, [0]]).astype(int)) == 1))
        assert not pixels[runs:].any()
        if runs:
            np.testing.assert_array_equal(pixels[:runs], by_pixels[pixels[:1].tobytes()].pixel_values)
    with pytest.raises(JaxtuneError, match="holds 2 pixel arrays .*max_images_per_row = 1 must be at least that"):
        epoch_batches(examples, 4, 200, 0, 0, images=ImageRows(1, processor.pixel_shape))


def gemma3_run_dir(directory):
    """test_vision_gemma3's tiny Gemma3ForConditionalGeneration saved with this module's tokenizer."""
    from test_vision_gemma3 import gemma3_vision_language

    from jaxtune.presets import write_gemma3_tokenizer

    model = gemma3_vision_language(directory)
    write_gemma3_tokenizer(directory)
    return model


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_batch_loss_equals_gemma3_for_conditional_generation(tmp_path):
    """SFT's `batch_loss` on a packed batch with images (the image side as the spine holds it, `params["vision"]`)
    equals the sum over its examples of transformers' loss (labels -100 outside the assistant text) x their
    target counts."""
    import jax
    import torch

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows, epoch_batches
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.sft import batch_loss
    from jaxtune.spine.model import load_vision_language_model

    model = gemma3_run_dir(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    processor = image_processor(tmp_path, tokenizer)
    short = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": "Yo."}]
    examples = [image_example(MESSAGES, [_picture(0), _picture(1)], processor, tokenizer),
                image_example(short, [_picture(2)], processor, tokenizer),
                image_example(TEXT_ONLY, [], processor, tokenizer)]
    batch, = epoch_batches(examples, 2, 120, 0, 0, images=ImageRows(3, processor.pixel_shape))
    assert batch["segment_ids"].max() >= 2  # packed
    cfg, params, _, vision_params = load_vision_language_model(tmp_path)
    ctx = Context(cfg, None, ForwardOptions(), images=image_side(tmp_path, 3))
    loss, count = jax.jit(batch_loss, static_argnums=2)({**params, "vision": vision_params}, batch, ctx)
    want_loss, want_count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.ids])
            labels = torch.where(torch.tensor([e.loss_mask]) == 1, ids, -100)
            pixels = torch.tensor(e.pixel_values) if e.images else None
            out = model(input_ids=ids, pixel_values=pixels, labels=labels,
                        token_type_ids=(ids == IMAGE).long())
            n = int(sum(e.loss_mask[1:]))
            want_loss, want_count = want_loss + float(out.loss) * n, want_count + n
    assert int(count) == want_count
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5)


def write_image_data(directory, n: int = 8):
    """n chat records, one or two pictures each (files beside the data), answers naming the pictures' colours."""
    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230)}
    for name, rgb in colours.items():
        Image.new("RGB", (40, 30), rgb).save(directory / f"{name}.png")
    names = list(colours)
    lines = []
    for i in range(n):
        shown = [names[i % 3]] + ([names[(i + 1) % 3]] if i % 2 else [])
        parts = [{"type": "image"} for _ in shown] + [{"type": "text", "text": "Colours?"}]
        lines.append({"messages": [{"role": "user", "content": parts},
                                   {"role": "assistant", "content": " and ".join(shown) + "."}],
                      "images": [f"{c}.png" for c in shown]})
    (directory / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return directory / "data.jsonl"


def run_config(root, method: str, steps: int):
    """A TOML run of `method` ("lora" on q_proj and v_proj, or "full") on root/model and root/data.jsonl."""
    from jaxtune.run_config import load_run_config

    kind = ['kind = "lora"', "rank = 4", 'target_modules = ["q_proj", "v_proj"]'] if method == "lora" else [
        'kind = "full"']
    text = "\n".join(["[model]", f'path = "{root / "model"}"', 'dtype = "float32"', "[method]", *kind, "[data]",
                      f'train = "{root / "data.jsonl"}"', "max_seq_len = 64", "eval_fraction = 0.25",
                      "max_images_per_row = 2", "[train]", f'output_dir = "{root / method}"', f"max_steps = {steps}",
                      "batch_size = 2", f"learning_rate = {3e-2 if method == 'lora' else 3e-3}", "log_every = 1",
                      "checkpoint_every = 3", "eval_every = 3"])
    (root / f"{method}.toml").write_text(text + "\n")
    return load_run_config(root / f"{method}.toml")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA run of 6 steps on images, then the same command with 8 steps (a resume)."""
    from jaxtune.train.loop import fine_tune

    root = tmp_path_factory.mktemp("vision_run")
    gemma3_run_dir(root / "model")
    write_image_data(root)
    logs: list[str] = []
    first = fine_tune(run_config(root, "lora", 6), log=logs.append)
    metrics = (root / "lora" / "metrics.jsonl").read_text()
    second = fine_tune(run_config(root, "lora", 8), log=logs.append)
    return root, first, second, metrics, logs


@pytest.mark.full
@pytest.mark.reference
def test_lora_sft_on_images_lowers_the_loss_and_resumes(trained):
    """`fine_tune` on a TOML config naming a Gemma 3 VLM directory: LoRA SFT with images (two a row) lowers the
    loss over 6 steps; a rerun with more steps resumes from the last checkpoint."""
    root, first, second, metrics, logs = trained
    losses = [json.loads(line)["loss"] for line in metrics.splitlines() if '"loss"' in line]
    assert first.step == 6 and len(losses) >= 6 and losses[-1] < losses[0]
    assert first.eval_loss is not None and np.isfinite(first.eval_loss)
    assert second.step == 8 and any("resum" in line.lower() for line in logs)


def _hf_logits(model, ids, pixels):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                     token_type_ids=torch.tensor(ids == IMAGE, dtype=torch.long)).logits.numpy()


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_adapter_loads_in_peft_and_merged_export_in_transformers(trained, tmp_path):
    """The run's adapter, keys as PEFT names them on Gemma3ForConditionalGeneration, loads with PEFT onto the
    transformers VLM: its logits with images equal jaxtune's; `export_merged` writes the whole VLM directory
    (tower and projector too), which transformers loads with the same logits; so does `export_run`'s from the
    run's last checkpoint."""
    import jax.numpy as jnp
    import transformers
    from peft import PeftModel
    from safetensors import safe_open

    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.gemma3 import vision_language_forward
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.export import export_merged, export_run

    root = trained[0]
    adapter = root / "lora" / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), "np") as f:
        names = sorted(f.keys())
    assert names and all(n.startswith("base_model.model.model.language_model.layers.") for n in names)
    tokenizer = load_tokenizer(root / "model")
    example = image_example(MESSAGES, [_picture(0), _picture(1)], image_processor(root / "model", tokenizer), tokenizer)
    ids, pixels = np.asarray([example.ids]), example.pixel_values
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(root / "model", dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. PEFT's "missing adapter keys" (LoRA on the tower)
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
    assert not [n for n, _ in peft_model.named_parameters() if "lora" in n and "language_model" not in n]
    want = _hf_logits(peft_model, ids, pixels)
    cfg, params, vision, vision_params = load_vision_language_model(root / "model")
    method, params = load_peft_adapter(adapter, params, cfg)
    ours = vision_language_forward(params, vision_params, jnp.asarray(ids), jnp.asarray(pixels), cfg, vision,
                                   method=method)
    assert np.abs(np.asarray(ours) - want).max() > 0  # the adapter changed the model
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-4)
    merged = export_merged(root / "model", adapter, tmp_path / "merged")
    assert (merged / "preprocessor_config.json").is_file()
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(merged, dtype="float32").eval()
    np.testing.assert_allclose(_hf_logits(model, ids, pixels), want, rtol=1e-5, atol=1e-4)
    again = export_run(root / "lora", "merged", tmp_path / "from_checkpoint")  # `jaxtune export`'s path
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(again, dtype="float32").eval()
    np.testing.assert_allclose(_hf_logits(model, ids, pixels), want, rtol=1e-5, atol=1e-4)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_full_fine_tune_on_images_writes_the_whole_vlm(trained):
    """A full fine-tune of the language model on images (the tower frozen): its model/ directory loads in
    transformers as a Gemma3ForConditionalGeneration whose tower equals the base's and whose logits equal
    jaxtune's forward of the trained weights."""
    import jax.numpy as jnp
    import torch
    import transformers

    from jaxtune.models.vision.gemma3 import vision_language_forward
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.loop import fine_tune

    root = trained[0]
    result = fine_tune(run_config(root, "full", 2), log=lambda _: None)
    out = root / "full" / "model"
    assert result.result_path == out
    trained_model = transformers.Gemma3ForConditionalGeneration.from_pretrained(out, dtype="float32").eval()
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(root / "model", dtype="float32")
    for (name, a), (_, b) in zip(trained_model.model.vision_tower.named_parameters(),
                                 base.model.vision_tower.named_parameters()):
        assert torch.equal(a, b), name
    tokenizer = load_tokenizer(root / "model")
    example = image_example(MESSAGES, [_picture(0), _picture(1)], image_processor(root / "model", tokenizer), tokenizer)
    ids, pixels = np.asarray([example.ids]), example.pixel_values
    cfg, params, vision, vision_params = load_vision_language_model(out)
    ours = vision_language_forward(params, vision_params, jnp.asarray(ids), jnp.asarray(pixels), cfg, vision)
    want = _hf_logits(trained_model, ids, pixels)
    assert np.abs(want - _hf_logits(base.eval(), ids, pixels)).max() > 1e-3  # trained
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-4)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_generation_with_images_equals_transformers_generate(trained, capsys):
    """`generate_ids_with_images` (the run's adapter on, greedy, 8 tokens) equals transformers' `generate` of the
    PEFT model on the prompt Gemma3Processor writes; `jaxtune generate --image A --image B` prints that text."""
    import torch
    import transformers
    from peft import PeftModel

    from jaxtune.cli import main
    from jaxtune.config import SamplingConfig
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids

    root = trained[0]
    adapter = root / "lora" / "adapter"
    generator = load_image_generator(root / "model", adapter)
    images = [_picture(0), _picture(1)]
    ids, pixels = prompt_ids(generator.processor, "Colours?", images)
    ours = generate_ids_with_images(generator, ids, pixels, SamplingConfig(max_new_tokens=8))
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(root / "model", dtype="float32")
    model = PeftModel.from_pretrained(base, adapter).eval()
    tokens = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=tokens, pixel_values=torch.tensor(pixels),
                             token_type_ids=(tokens == IMAGE).long(), do_sample=False, max_new_tokens=8,
                             min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(ids):].tolist()
    for i, image in enumerate(images):
        image.save(root / f"p{i}.png")
    main(["generate", "--model", str(root / "model"), "--adapter", str(adapter), "--prompt", "Colours?",
          "--image", str(root / "p0.png"), "--image", str(root / "p1.png"), "--max-new-tokens", "8"])
    eos = ours.index(1) if 1 in ours else len(ours)
    assert capsys.readouterr().out.strip() == load_tokenizer(root / "model").decode(ours[:eos]).strip()


def test_planner_counts_the_image_side_of_gemma3_4b():
    """gemma-3-4b-it as released, LoRA SFT with 2 images a row on an H100, planned without allocating: the frozen
    weights hold the tower and projector (bfloat16) beside the text model, and the tower's forward is a moment of
    its own, its bytes as `tower_bytes` counts them for the device's rows."""
    import jax
    from test_vision_gemma3 import RELEASED

    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.models.hf_config import config_from_hf
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.family import ImageSide
    from jaxtune.models.vision.gemma3 import GEMMA3, tower_bytes
    from jaxtune.models.vision.hf import vision_config_from_hf, vision_param_specs
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device

    cfg, vision = config_from_hf(RELEASED), vision_config_from_hf(RELEASED)
    plan = TrainPlan(method_config("lora", rank=8), batch_size=2, seq_len=1024)
    with_images = plan.replace(images=ImageSide(GEMMA3, vision, 2, (3, 896, 896)))
    text, both = (estimate(cfg, p, get_device("h100")) for p in (plan, with_images))
    tower = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(vision_param_specs(vision),
                                                               is_leaf=lambda x: isinstance(x, ParamSpec)))
    assert 400e6 < tower < 450e6 and both.frozen_bytes - text.frozen_bytes == 2 * tower
    assert both.phases["image side"]["activations"] == tower_bytes(vision, (3, 896, 896), 2 * 2, 2)
    assert "image side" not in text.phases


def write_preference_data(root) -> None:
    """Preference pairs about the colour pictures of `write_image_data`, TRL's vision format."""
    lines = []
    for i, (right, wrong) in enumerate([("red", "blue"), ("green", "red"), ("blue", "green"), ("red", "green")]):
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
        lines.append({"prompt": prompt, "chosen": f"{right.title()}.", "rejected": f"{wrong.title()}!",
                      "images": [f"{right}.png"]})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_dpo_with_images_equals_the_dpo_formula_on_transformers_logps(trained):
    """Pairs whose prompts hold images: DPO's loss on a pair batch (policy: the run's LoRA adapter, reference: the
    base with it off, both reading the images) equals TRL's sigmoid DPO loss on transformers' sequence log-probs of
    the same ids; and one `fine_tune` step of objective dpo on those pairs runs through the spine."""
    import dataclasses

    import jax
    import torch
    import torch.nn.functional as F
    import transformers
    from peft import PeftModel

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows
    from jaxtune.data.image_examples import image_preference_examples
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.base import Context, strip_adapters
    from jaxtune.objectives.dpo import PreferenceConfig, _pair_sums, pair_batch
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.loop import fine_tune

    root = trained[0]
    write_preference_data(root)
    tokenizer = load_tokenizer(root / "model")
    processor = image_processor(root / "model", tokenizer)
    pairs = list(image_preference_examples(root / "pairs.jsonl", tokenizer, processor, 64))
    assert [p.images for p in pairs] == [1] * 4 and tokenizer.decode(list(pairs[0].chosen)) == "Red."
    batch = pair_batch(pairs[:3], 3, 64, images=ImageRows(2, processor.pixel_shape))
    assert batch["pixel_values"].shape == (6, 2, 3, 64, 64)
    cfg, params, _, vision_params = load_vision_language_model(root / "model")
    method, policy = load_peft_adapter(root / "lora" / "adapter", params, cfg)
    section = PreferenceConfig(beta=0.5)
    ctx = Context(cfg, method, ForwardOptions(), section, images=image_side(root / "model", 2))
    policy = {**policy, "vision": vision_params}
    loss, count, _ = jax.jit(_pair_sums, static_argnums=3)(policy, strip_adapters(policy), batch, ctx)

    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(root / "model", dtype="float32")
    model = PeftModel.from_pretrained(base, root / "lora" / "adapter").eval()

    def logp(pair, completion):
        ids = torch.tensor([pair.prompt + completion])
        out = model(input_ids=ids, pixel_values=torch.tensor(pair.pixel_values), token_type_ids=(ids == IMAGE).long())
        logps = torch.log_softmax(out.logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        return logps[len(pair.prompt) - 1:].sum()

    want = 0.0
    with torch.no_grad():
        for pair in pairs[:3]:
            chosen, rejected = logp(pair, pair.chosen), logp(pair, pair.rejected)
            with model.disable_adapter():
                ref_chosen, ref_rejected = logp(pair, pair.chosen), logp(pair, pair.rejected)
            want += float(-F.logsigmoid(section.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))))
    assert float(count) == 3
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)

    config = run_config(root, "lora", 1)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, train=str(root / "pairs.jsonl")),
                                 train=dataclasses.replace(config.train, objective="dpo", output_dir=str(root / "dpo"),
                                                           eval_every=0))
    result = fine_tune(config, log=lambda _: None)
    assert result.step == 1 and np.isfinite(result.train_loss)


def test_adapter_exclusions_keep_peft_off_the_tower():
    """`exclude_modules` as written for a VLM adapter: the tower's modules excluded, the method's own exclusions
    (names or a regex) kept, the text model's modules not excluded."""
    import re

    from jaxtune.methods.peft import excluding

    outside = r".*(vision_tower|multi_modal_projector).*"
    tower, text = "model.vision_tower.encoder.layers.0.self_attn.q_proj", "model.language_model.layers.0.mlp.up_proj"
    for own, excluded in ((None, ()), (("up_proj",), (text,)), (r".*\.mlp\..*", (text,))):
        pattern = excluding(own, outside)
        assert {p for p in (tower, text) if re.fullmatch(pattern, p)} == {tower, *excluded}


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_the_random_vision_preset_loads_in_transformers_with_the_same_logits(tmp_path):
    """`presets.write_random_vision_model` (the vision demo's base, written without torch): transformers' Gemma 3
    VLM loads every tensor, and its logits with an image equal jaxtune's."""
    import jax.numpy as jnp
    import transformers

    from jaxtune.image_generation import load_image_generator, prompt_ids
    from jaxtune.models.head import head_logits
    from jaxtune.models.llama import decoder
    from jaxtune.presets import write_random_vision_model

    directory = write_random_vision_model(tmp_path / "m", seed=1, hidden_size=128, intermediate_size=256)
    generator = load_image_generator(directory)
    ids, pixels = prompt_ids(generator.processor, "Colour?", [_picture(3, (64, 64))])
    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory, dtype="float32",
                                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    text, images = generator.processor.family.image_inputs(generator.vision_params, jnp.asarray([ids]),
                                                           jnp.asarray(pixels), None, generator.cfg,
                                                           generator.processor.config, jnp.float32)
    ours = np.asarray(head_logits(generator.params, decoder(generator.params, text, generator.cfg, **images)))
    np.testing.assert_allclose(ours, _hf_logits(model.eval(), np.asarray([ids]), pixels), rtol=1e-5, atol=1e-4)


def test_a_vision_language_model_is_refused_as_gguf_in_one_line(tmp_path):
    from jaxtune.errors import JaxtuneError
    from jaxtune.presets import write_gemma3_files
    from jaxtune.train.export import export_gguf, export_gguf_lora

    model = write_gemma3_files(tmp_path / "m")  # the refusal comes before any weight is read
    for export in (lambda: export_gguf(model, None, tmp_path / "m.gguf"),
                   lambda: export_gguf_lora(model, tmp_path / "adapter", tmp_path / "a.gguf")):
        with pytest.raises(JaxtuneError, match=r"m: a vision-language model \(Gemma3ForConditionalGeneration\); "
                                               r"llama.cpp reads its image side from a separate mmproj GGUF"):
            export()
    assert not (tmp_path / "m.gguf").exists()
