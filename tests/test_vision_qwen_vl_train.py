"""Fine-tuning Qwen2.5-VL with images (issue 52; `models/vision/qwen2_5_vl.py`): chat records become ids as
Qwen2_5_VLProcessor writes them (each `<|image_pad|>` one run of an image's merged tokens), the loss on the assistant's
text only, each image a padded pixel array with its grid; the planner counts the 3B's tower. Full tier, on a tiny
Qwen2_5_VLForConditionalGeneration: ids and pixels equal the processor's; a packed batch's loss equals transformers';
LoRA SFT through `fine_tune` lowers the loss and resumes; the adapter loads in PEFT and the merged export in
transformers with the same logits; greedy generation with images equals `generate`; DPO with images equals the DPO
formula on transformers' log-probs, KTO's TRL's."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from qwen_vl_files import QWEN_IMAGE, QWEN_PROCESSING, QWEN_TEXT, QWEN_VISION, write_qwen_vl_files

from jaxtune.data.image_examples import image_example
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.models.vision.families import image_processor

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red and blue."}]},
            {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Green."}]
SHORT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
         {"role": "assistant", "content": "Yo."}]
TEXT_ONLY = [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Yo."}]
SIZES = [(40, 30), (20, 52), (64, 64)]  # (width, height): grids 8 x 10, 12 x 4, 12 x 12 patches (the last one shrunk)


def _picture(seed: int, size=(40, 30)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def _hf_inputs(example) -> dict:
    """transformers' keyword arguments of an `ImageExample`: its patches concatenated, its grids."""
    import torch

    ids = torch.tensor([example.ids])
    out = dict(input_ids=ids, mm_token_type_ids=(ids == QWEN_IMAGE).long())
    if example.images:
        grids = np.round(example.pixel_values[:, 0, :3]).astype(np.int64)
        out["pixel_values"] = torch.tensor(np.concatenate([a[1:1 + int(np.prod(g))] for a, g in
                                                           zip(example.pixel_values, grids)]))
        out["image_grid_thw"] = torch.tensor(grids)
    return out


def test_ids_loss_mask_and_padded_pixel_arrays(tmp_path):
    """Each image's `<|image_pad|>` run as long as its merged grid, bracketed by the vision tokens; the loss on the
    assistant's text alone; pixel arrays [1 + 192, 96], row 0 the grid, zeros past the patches."""
    model_dir = write_qwen_vl_files(tmp_path)
    tokenizer = load_tokenizer(model_dir)
    processor = image_processor(model_dir, tokenizer)
    example = image_example(MESSAGES, [_picture(0, SIZES[0]), _picture(1, SIZES[1])], processor, tokenizer)
    ids, mask = np.asarray(example.ids), np.asarray(example.loss_mask)
    assert processor.pixel_shape == (193, 96) and example.pixel_values.shape == (2, 193, 96)
    grids = example.pixel_values[:, 0, :3].tolist()
    assert grids == [[1, 8, 10], [1, 12, 4]] and not example.pixel_values[0, 1 + 80:].any()
    assert (ids == QWEN_IMAGE).sum() == 20 + 12
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert f"<|vision_start|>{'<|image_pad|>' * 20}<|vision_end|>What colour?<|vision_start|>" in text
    trained = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "Red and blue.<|im_end|>Green.<|im_end|>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, model): a tiny random Qwen2_5_VLForConditionalGeneration, float32, `save_pretrained`, with the
    tokenizer and preprocessor files."""
    import torch
    import transformers
    from hf_models import randomize

    config = transformers.Qwen2_5_VLConfig(
        text_config={**QWEN_TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                      "rope_theta": 1e4}},
        vision_config=QWEN_VISION, image_token_id=QWEN_IMAGE, video_token_id=91, vision_start_token_id=92,
        vision_end_token_id=93)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen2_5_VLForConditionalGeneration(config), 0)
    directory = tmp_path_factory.mktemp("qwen_vl") / "model"
    model.save_pretrained(directory)
    write_qwen_vl_files(directory, config=False)
    return directory, model.eval()


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_ids_and_pixels_equal_qwen2_5_vl_processor(saved):
    """transformers' Qwen2_5_VLProcessor on the chat template's text: the same ids, the same patches and grids (its
    video processor left out: it needs torchvision)."""
    import transformers

    class ImagesOnly(transformers.Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id, self.video_token_id = QWEN_IMAGE, 91
            transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    directory, _ = saved
    tokenizer = load_tokenizer(directory)
    images = [_picture(0, SIZES[0]), _picture(1, SIZES[2])]
    example = image_example(MESSAGES, images, image_processor(directory, tokenizer), tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    processor = ImagesOnly(transformers.Qwen2VLImageProcessorPil(**QWEN_PROCESSING), hf_tokenizer,
                           chat_template=hf_tokenizer.chat_template)
    text = processor.apply_chat_template(MESSAGES, tokenize=False)
    want = processor(text=[text], images=images, add_special_tokens=False, return_tensors="np")
    assert list(example.ids) == want["input_ids"][0].tolist()
    ours = _hf_inputs(example)
    np.testing.assert_array_equal(ours["image_grid_thw"].numpy(), want["image_grid_thw"])
    np.testing.assert_allclose(ours["pixel_values"].numpy(), want["pixel_values"], rtol=1e-6, atol=1e-6)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_batch_loss_equals_qwen2_5_vl_for_conditional_generation(saved):
    """SFT's `batch_loss` on a packed batch (two images of different sizes in a row, a text-only example beside)
    equals the sum over its examples of transformers' loss (labels -100 outside the assistant text) x their target
    counts; `load_vision_language_model` reads the unit."""
    import jax
    import torch

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows, epoch_batches
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.sft import batch_loss
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    tokenizer = load_tokenizer(directory)
    processor = image_processor(directory, tokenizer)
    examples = [image_example(MESSAGES, [_picture(0, SIZES[0]), _picture(1, SIZES[1])], processor, tokenizer),
                image_example(SHORT, [_picture(2, SIZES[2])], processor, tokenizer),
                image_example(TEXT_ONLY, [], processor, tokenizer)]
    batch, = epoch_batches(examples, 2, 256, 0, 0, images=ImageRows(3, processor.pixel_shape))
    assert batch["segment_ids"].max() >= 2  # packed
    cfg, params, _, vision_params = load_vision_language_model(directory)
    ctx = Context(cfg, None, ForwardOptions(), images=image_side(directory, 3))
    loss, count = jax.jit(batch_loss, static_argnums=2)({**params, "vision": vision_params}, batch, ctx)
    want_loss, want_count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            inputs = _hf_inputs(e)
            labels = torch.where(torch.tensor([e.loss_mask]) == 1, inputs["input_ids"], -100)
            n = int(sum(e.loss_mask[1:]))
            want_loss += float(model(**inputs, labels=labels).loss) * n
            want_count += n
    assert int(count) == want_count
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5)


def _run_config(root, steps: int):
    """LoRA on q_proj, v_proj and the MLP's projections (names the tower's blocks share) on root/model."""
    from jaxtune.run_config import load_run_config

    text = "\n".join(["[model]", f'path = "{root / "model"}"', 'dtype = "float32"', "[method]", 'kind = "lora"',
                      "rank = 4", 'target_modules = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]',
                      "[data]", f'train = "{root / "data.jsonl"}"', "max_seq_len = 160", "eval_fraction = 0.25",
                      "max_images_per_row = 2", "[train]", f'output_dir = "{root / "lora"}"', f"max_steps = {steps}",
                      "batch_size = 2", "learning_rate = 3e-2", "log_every = 1", "checkpoint_every = 3",
                      "eval_every = 3"])
    (root / "lora.toml").write_text(text + "\n")
    return load_run_config(root / "lora.toml")


@pytest.fixture(scope="module")
def trained(saved):
    """A LoRA run of 6 steps on images of three sizes, then the same command with 8 steps (a resume)."""
    from test_vision_train import write_image_data

    from jaxtune.train.loop import fine_tune

    root = saved[0].parent
    data = write_image_data(root)
    for i, (name, size) in enumerate(zip(("red", "green", "blue"), SIZES)):
        Image.open(root / f"{name}.png").resize(size).save(root / f"{name}.png")
    logs: list[str] = []
    first = fine_tune(_run_config(root, 6), log=logs.append)
    metrics = (root / "lora" / "metrics.jsonl").read_text()
    second = fine_tune(_run_config(root, 8), log=logs.append)
    assert data.is_file()
    return root, first, second, metrics, logs


@pytest.mark.full
@pytest.mark.reference
def test_lora_sft_on_images_lowers_the_loss_and_resumes(trained):
    root, first, second, metrics, logs = trained
    losses = [json.loads(line)["loss"] for line in metrics.splitlines() if '"loss"' in line]
    assert first.step == 6 and len(losses) >= 6 and losses[-1] < losses[0]
    assert first.eval_loss is not None and np.isfinite(first.eval_loss)
    assert second.step == 8 and any("resum" in line.lower() for line in logs)


def _logits(model, example) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(**_hf_inputs(example)).logits.numpy()


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_adapter_loads_in_peft_and_merged_export_in_transformers(trained, tmp_path):
    """The run's adapter (keys under `model.language_model.`, none on `visual.*`, whose blocks share the MLP's names)
    loads with PEFT onto the transformers VLM with jaxtune's logits; `export_merged` writes the whole VLM, which
    transformers loads with the same logits."""
    import warnings

    import transformers
    from peft import PeftModel
    from safetensors import safe_open

    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.qwen2_5_vl import QWEN2_5_VL
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.export import export_merged

    root = trained[0]
    adapter = root / "lora" / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), "np") as f:
        names = sorted(f.keys())
    assert names and all(n.startswith("base_model.model.model.language_model.layers.") for n in names)
    tokenizer = load_tokenizer(root / "model")
    example = image_example(MESSAGES, [_picture(0, SIZES[0]), _picture(1, SIZES[2])],
                            image_processor(root / "model", tokenizer), tokenizer)
    load = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        peft_model = PeftModel.from_pretrained(load(root / "model", dtype="float32"), adapter).eval()
    assert not [n for n, _ in peft_model.named_parameters() if "lora" in n and "language_model" not in n]
    want = _logits(peft_model, example)
    cfg, params, vision, vision_params = load_vision_language_model(root / "model")
    method, params = load_peft_adapter(adapter, params, cfg)
    ours = QWEN2_5_VL.forward(params, vision_params, jnp.asarray([example.ids]), jnp.asarray(example.pixel_values),
                              cfg, vision, method=method)
    assert np.abs(np.asarray(ours) - want).max() > 0
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-4)
    merged = export_merged(root / "model", adapter, tmp_path / "merged")
    np.testing.assert_allclose(_logits(load(merged, dtype="float32").eval(), example), want, rtol=1e-5, atol=1e-4)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_generation_with_images_equals_transformers_generate(trained, capsys):
    """`generate_ids_with_images` (the adapter on, greedy, 8 tokens) equals transformers' `generate` of the PEFT
    model; `jaxtune generate --image A --image B` prints that text."""
    import torch
    import transformers
    from peft import PeftModel

    from jaxtune.cli import main
    from jaxtune.config import SamplingConfig
    from jaxtune.data.image_examples import ImageExample
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids

    root = trained[0]
    adapter = root / "lora" / "adapter"
    generator = load_image_generator(root / "model", adapter)
    images = [_picture(0, SIZES[1]), _picture(1, SIZES[2])]
    ids, pixels = prompt_ids(generator.processor, "Colours?", images)
    ours = generate_ids_with_images(generator, ids, pixels, SamplingConfig(max_new_tokens=8))
    base = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "model", dtype="float32")
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        out = model.generate(**_hf_inputs(ImageExample(tuple(ids), (0,) * len(ids), pixels)), do_sample=False,
                             max_new_tokens=8, min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(ids):].tolist()
    for i, image in enumerate(images):
        image.save(root / f"p{i}.png")
    main(["generate", "--model", str(root / "model"), "--adapter", str(adapter), "--prompt", "Colours?",
          "--image", str(root / "p0.png"), "--image", str(root / "p1.png"), "--max-new-tokens", "8"])
    eos = ours.index(2) if 2 in ours else len(ours)
    assert capsys.readouterr().out.strip() == load_tokenizer(root / "model").decode(ours[:eos]).strip()


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_dpo_with_images_equals_the_dpo_formula_on_transformers_logps(trained):
    """Pairs whose prompts hold images of different sizes: DPO's loss on a pair batch (policy: the run's adapter,
    reference: the base with it off) equals TRL's sigmoid DPO loss on transformers' sequence log-probs."""
    import jax
    import torch
    import torch.nn.functional as F
    import transformers
    from peft import PeftModel
    from test_vision_train import write_preference_data

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows
    from jaxtune.data.image_examples import ImageExample, image_preference_examples
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.base import Context, strip_adapters
    from jaxtune.objectives.dpo import PreferenceConfig, _pair_sums, pair_batch
    from jaxtune.spine.model import load_vision_language_model

    root = trained[0]
    write_preference_data(root)
    tokenizer = load_tokenizer(root / "model")
    processor = image_processor(root / "model", tokenizer)
    pairs = list(image_preference_examples(root / "pairs.jsonl", tokenizer, processor, 160))[:3]
    batch = pair_batch(pairs, 3, 160, images=ImageRows(2, processor.pixel_shape))
    cfg, params, _, vision_params = load_vision_language_model(root / "model")
    method, policy = load_peft_adapter(root / "lora" / "adapter", params, cfg)
    section = PreferenceConfig(beta=0.5)
    ctx = Context(cfg, method, ForwardOptions(), section, images=image_side(root / "model", 2))
    policy = {**policy, "vision": vision_params}
    loss, count, _ = jax.jit(_pair_sums, static_argnums=3)(policy, strip_adapters(policy), batch, ctx)
    base = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "model", dtype="float32")
    model = PeftModel.from_pretrained(base, root / "lora" / "adapter").eval()

    def logp(pair, completion):
        ids = pair.prompt + completion
        logits = model(**_hf_inputs(ImageExample(ids, (0,) * len(ids), pair.pixel_values))).logits
        logps = torch.log_softmax(logits[0, :-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return logps[len(pair.prompt) - 1:].sum()

    want = 0.0
    with torch.no_grad():
        for pair in pairs:
            chosen, rejected = logp(pair, pair.chosen), logp(pair, pair.rejected)
            with model.disable_adapter():
                ref_chosen, ref_rejected = logp(pair, pair.chosen), logp(pair, pair.rejected)
            want += float(-F.logsigmoid(section.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))))
    assert float(count) == 3
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_kto_with_images_equals_trl_kto_loss_on_transformers_logps(saved):
    """KTO rows and their KL rows with images of different sizes (`test_vision_kto.kto_against_trl`): jaxtune's loss
    equals TRL's formula on transformers' log-probs (patches and grids as `_hf_inputs` gives them)."""
    from test_vision_kto import kto_against_trl

    from jaxtune.data.image_examples import ImageExample
    from jaxtune.models.vision.qwen2_5_vl import QWEN2_5_VL

    def forward(model, ids, pixels):
        return model(**_hf_inputs(ImageExample(ids, (0,) * len(ids), pixels))).logits

    directory, model = saved
    ours, trl = kto_against_trl(directory.parent, model, forward, QWEN2_5_VL.outside_text, 160,
                                 seed=4)  # a LoRA whose z0 > 0 on this model
    np.testing.assert_allclose(ours, trl, rtol=1e-4)


def test_planner_counts_the_image_side_of_qwen2_5_vl_3b():
    """Qwen2.5-VL-3B-Instruct as released, LoRA SFT with 2 images a row of the processor's default patch budget on an
    H100, planned without allocating: the frozen weights hold the tower beside the text model, and its forward over the
    padded patches is a moment of its own."""
    import jax
    from test_vision_qwen_vl_model import RELEASED

    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.models.hf_config import config_from_hf
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.family import ImageSide
    from jaxtune.models.vision.qwen2_5_vl import QWEN2_5_VL, pixel_shape, tower_bytes
    from jaxtune.models.vision.qwen_vl_config import QwenImageOptions, vision_language_config_from_hf
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device

    cfg = config_from_hf(RELEASED)
    vision = vision_language_config_from_hf(RELEASED, cfg.hidden_size)
    shape = pixel_shape(QwenImageOptions())  # the processor's default max_pixels, 28 * 28 * 1280
    assert shape == (1 + 5120, 1176) and pixel_shape(QwenImageOptions(max_pixels=12845056))[0] == 1 + 65536
    plan = TrainPlan(method_config("lora", rank=8), batch_size=2, seq_len=1024)
    with_images = plan.replace(images=ImageSide(QWEN2_5_VL, vision, 2, shape))
    text, both = (estimate(cfg, p, get_device("h100")) for p in (plan, with_images))
    tower = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(QWEN2_5_VL.param_specs(vision),
                                                               is_leaf=lambda x: isinstance(x, ParamSpec)))
    assert 600e6 < tower < 700e6 and both.frozen_bytes - text.frozen_bytes == 2 * tower
    assert both.phases["image side"]["activations"] == tower_bytes(vision, shape, 2 * 2, 2)
