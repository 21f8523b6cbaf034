"""Gemma 4's vision side (`models/vision/gemma4.py`, issue 52) against transformers 5's Gemma4ForConditionalGeneration
(a tiny random float32 one, `gemma4_vl_files.py`): the image processor's pixel values and positions as
`Gemma4ImageProcessorPil`'s on images of several sizes and aspect ratios; logits with 1 and 3 images; LoRA gradients
as PEFT's; greedy decoding as `generate`; one SFT step through `fine_tune`, whose adapter PEFT loads with the same
logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.gemma4 import GEMMA4, Gemma4ImageOptions, image_arrays, read_processing

pytestmark = [pytest.mark.parity, pytest.mark.reference]


def pictures() -> list[Image.Image]:
    """Noisy images of different sizes, aspect ratios and modes (RGB, RGBA, L, a 1-pixel-high strip)."""
    rng = np.random.RandomState(0)
    shapes = [((60, 100), "RGB"), ((91, 37), "RGBA"), ((20, 300), "L"), ((64, 64), "RGB"), ((140, 45), "RGB"),
              ((1, 500), "RGB")]
    return [Image.fromarray(rng.randint(0, 256, (h, w, 4), np.uint8), "RGBA").convert(mode) for (h, w), mode in shapes]


def test_image_processor_equals_transformers(tmp_path):
    """Pixel values, patch positions and soft-token counts equal `Gemma4ImageProcessorPil`'s (float32 rounding), the
    settings read from its saved preprocessor_config.json; a budget it does not know is one line."""
    import transformers
    from gemma4_vl_files import PROCESSING

    reference = transformers.Gemma4ImageProcessorPil(**PROCESSING)
    reference.save_pretrained(tmp_path)
    options = read_processing(tmp_path)
    assert options == Gemma4ImageOptions(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3,
                                         rescale_factor=1 / 255)
    images = pictures()
    want = reference(images, return_tensors="np")
    ours, counts = image_arrays(images, options)
    assert counts == list(want["num_soft_tokens_per_image"]) and len(set(counts)) > 3
    np.testing.assert_array_equal(ours[..., :2], want["image_position_ids"])
    np.testing.assert_allclose(ours[..., 2:], want["pixel_values"], rtol=1e-6, atol=1e-6)
    assert ours.shape[1:] == GEMMA4.pixel_shape(options)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PROCESSING, "max_soft_tokens": 100}))
    with pytest.raises(JaxtuneError, match="max_soft_tokens 100 \\(Gemma 4's are \\(70, 140, 280, 560, 1120\\)\\)"):
        read_processing(tmp_path)


@pytest.mark.full  # the spans' kernel mechanism stays everyday in test_vision_gemma3.py
def test_image_spans_on_sliding_layers_only(monkeypatch):
    """Gemma 4's mask (`span_ids(sliding_only=True)`), two rows of 48 tokens in blocks of 16, images across the
    blocks' borders: on a full layer (window 0) the blockwise kernel is causal, on a sliding one (window 7) an image's
    tokens also see its later tokens within the window: dense attention under transformers' masks (the backward
    shares `_allowed` and the liveness; Gemma 3's spans test takes gradients)."""
    from test_vision_gemma3 import dense_attention

    from jaxtune.models import attention
    from jaxtune.models.attention import blockwise_attention, training_mask
    from jaxtune.models.multimodal import span_ids

    monkeypatch.setattr(attention, "BLOCK", 16)
    B, K, G, T, hd = 2, 1, 2, 48, 8
    at = np.zeros((B, T), bool)
    at[0, 3:7] = at[0, 13:20] = at[1, 30:36] = True
    spans = span_ids(jnp.asarray(at), sliding_only=True)
    assert np.asarray(spans)[0, [2, 3, 13]].tolist() == [-1, attention.SLIDING_SPANS, attention.SLIDING_SPANS + 1]
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(
        [(B, K, G, T, hd), (B, K, T, hd), (B, K, T, hd)]))
    mask = training_mask(B, T, 0, None, None, span_ids_BxT=spans)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.asarray(spans)
    same = (s[:, :, None] == s[:, None, :]) & (s[:, :, None] >= 0)
    for window, allowed in ((0, np.broadcast_to(j <= i, same.shape)), (7, ((j <= i) | same) & (j > i - 7))):
        ours = lambda q, k, v: blockwise_attention(q, k, v, mask, window, scale=0.3)  # noqa: E731
        want = lambda q, k, v: dense_attention(q, k, v, jnp.asarray(allowed), 0.3)  # noqa: E731
        np.testing.assert_allclose(ours(q, k, v), want(q, k, v), atol=2e-5)


def test_vision_config_refusals_are_one_line():
    """What the tower does not compute is refused naming the key and value; transformers' defaults read."""
    from jaxtune.models.vision.gemma4_vision import vision_config_from_hf

    tower = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    cfg = vision_config_from_hf({"vision_config": tower}, 64)
    assert (cfg.num_kv_heads, cfg.patch_size, cfg.pooling_kernel_size, cfg.rope_theta) == (2, 16, 3, 100.0)
    for change, message in [({"hidden_activation": "gelu"}, "vision_config hidden_activation 'gelu'"),
                            ({"rope_parameters": {"rope_type": "default"}}, "rope_parameters.rope_type 'default'"),
                            ({"head_dim": None}, "vision_config has no head_dim"),
                            ({"head_dim": 18}, "head_dim 18 must be a multiple of 4")]:
        with pytest.raises(JaxtuneError, match=message):
            vision_config_from_hf({"vision_config": tower | change}, 64)
    with pytest.raises(JaxtuneError, match="config.json: Gemma4ForConditionalGeneration without a vision_config"):
        vision_config_from_hf({}, 64)


def test_an_audio_part_in_data_is_one_line(tmp_path):
    """A record with an audio part (or an "audio" key) is refused naming its line: the audio tower is left."""
    from jaxtune.data.images import record_images

    audio = {"messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Heard?"}]}]}
    with pytest.raises(JaxtuneError, match="^data.jsonl:3: a part of type 'audio': jaxtune trains on text and"):
        record_images(audio, "data.jsonl:3", tmp_path, 0)
    with pytest.raises(JaxtuneError, match="^data.jsonl:4: key 'audio': jaxtune trains on text and images"):
        record_images({"prompt": "Hi", "audio": "a.wav"}, "data.jsonl:4", tmp_path, 0)
    assert record_images({"messages": [{"role": "user", "content": "Hi"}]}, "data.jsonl:5", tmp_path, 0) == []


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, model): the tiny random Gemma4ForConditionalGeneration saved by transformers."""
    from gemma4_vl_files import write_gemma4_vl

    directory = tmp_path_factory.mktemp("gemma4_vl") / "model"
    return directory, write_gemma4_vl(directory)


MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": "Two pictures."}]


@pytest.mark.full
def test_ids_and_pixels_equal_gemma4_processor(saved):
    """transformers' Gemma4Processor on the chat template's text (its feature extractor and video processor left
    out): the same ids, pixel values and positions; the loss on the assistant's text only."""
    import transformers
    from gemma4_vl_files import BOI, EOI, IMAGE, PROCESSING

    from jaxtune.data.image_examples import image_example
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.models.vision.families import image_processor

    class ImagesOnly(transformers.Gemma4Processor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            self.image_token, self.boi_token, self.eoi_token = "<|image|>", "<|image>", "<image|>"
            self.image_token_id, self.image_seq_length = IMAGE, 70
            self.video_token = self.audio_token = self.boa_token = self.eoa_token = None
            self.video_token_id = self.audio_token_id = None
            transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def validate_inputs(self, **kwargs):  # its audio-token check needs a tokenizer with audio tokens
            pass

    directory, _ = saved
    tokenizer = load_tokenizer(directory)
    images = [pictures()[0], pictures()[4]]
    example = image_example(MESSAGES, images, image_processor(directory, tokenizer), tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    processor = ImagesOnly(transformers.Gemma4ImageProcessorPil(**PROCESSING), hf_tokenizer,
                           chat_template=hf_tokenizer.chat_template)
    text = processor.apply_chat_template(MESSAGES, tokenize=False)
    want = processor(text=[text], images=images, add_special_tokens=False, return_tensors="np")
    ids = np.asarray(example.ids)
    assert ids.tolist() == want["input_ids"][0].tolist() and (ids == BOI).sum() == (ids == EOI).sum() == 2
    np.testing.assert_array_equal(example.pixel_values[..., :2], want["image_position_ids"])
    np.testing.assert_allclose(example.pixel_values[..., 2:], want["pixel_values"], rtol=1e-6, atol=1e-6)
    learned = tokenizer.decode([t for t, m in zip(example.ids, example.loss_mask) if m])
    assert learned.startswith("Two pictures.") and IMAGE not in ids[np.asarray(example.loss_mask) == 1]


def image_rows(rows: list[list], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, T], attention mask [B, T]) of rows where "image" takes the next image's boi, soft tokens, eoi,
    left-padded with 0 to the longest."""
    from gemma4_vl_files import BOI, EOI, IMAGE

    sizes = iter(counts)
    out = [[t for item in row for t in ([BOI, *[IMAGE] * next(sizes), EOI] if item == "image" else [item])]
           for row in rows]
    T = max(map(len, out))
    tokens, mask = np.zeros((len(out), T), np.int64), np.zeros((len(out), T), np.int64)
    for b, row in enumerate(out):
        tokens[b, T - len(row):], mask[b, T - len(row):] = row, 1
    return tokens, mask


def torch_inputs(tokens, mask, images) -> dict:
    """transformers' keyword arguments: its processor's pixel values and positions, `mm_token_type_ids`."""
    import torch
    import transformers
    from gemma4_vl_files import IMAGE, PROCESSING

    processed = transformers.Gemma4ImageProcessorPil(**PROCESSING)(images, return_tensors="pt")
    return dict(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                pixel_values=processed["pixel_values"], image_position_ids=processed["image_position_ids"],
                mm_token_type_ids=torch.from_numpy((tokens == IMAGE).astype(np.int64)))


@pytest.mark.full
@pytest.mark.parametrize("rows,images", [
    ([[2, 17, 5, "image", 33, 8, 61, 12]], [0]),
    ([[2, "image", 40, "image", 7, 8, 3, 9], [2, *range(11, 17), "image", 23, 24]], [0, 2, 4]),
], ids=["one_image", "three_images"])
def test_logits_equal_gemma4_for_conditional_generation(saved, rows, images):
    """Read through `load_vision_language_model`, images processed by jaxtune: every real token's logits equal
    transformers' (float32: to 5e-5 of the largest; where they differ most, jaxtune's are the nearer to transformers'
    in float64), images of different sizes, left padding, spans on sliding layers (without them: off by ~4)."""
    import torch

    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    assert vision.bidirectional and vision.tower.use_clipped_linears
    chosen = [pictures()[i] for i in images]
    arrays, counts = image_arrays(chosen, read_processing(directory))
    tokens, mask = image_rows(rows, counts)
    with torch.no_grad():
        want = model(**torch_inputs(tokens, mask, chosen)).logits.numpy()
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    run = jax.jit(GEMMA4.forward, static_argnames=("cfg", "vision"))
    ours = np.asarray(run(params, vision_params, jnp.asarray(tokens), jnp.asarray(arrays), cfg=cfg, vision=vision,
                          attention_mask_BxT=jnp.asarray(mask), positions_BxT=jnp.asarray(positions)))
    real = mask > 0
    np.testing.assert_allclose(ours[real], want[real], rtol=1e-5, atol=5e-5 * np.abs(want[real]).max())


def _arrays_as_torch(arrays: np.ndarray) -> dict:
    """transformers' pixel_values and image_position_ids of the unit's pixel arrays."""
    import torch

    return dict(pixel_values=torch.from_numpy(arrays[..., 2:]),
                image_position_ids=torch.from_numpy(np.round(arrays[..., :2]).astype(np.int64)))


@pytest.mark.full
def test_lora_gradients_equal_peft(saved, tmp_path):
    """PEFT's LoRA on the text model's q_proj and v_proj (the tower excluded), read by `load_peft_adapter`: with two
    images in the row, the logits and d(loss)/d(LoRA A, B) equal PEFT's (float32, to 1e-4 of the largest)."""
    import copy

    import torch
    from gemma4_vl_files import IMAGE
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft

    from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    peft_model = randomize_peft(get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=GEMMA4.outside_text)))
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    arrays, counts = image_arrays(pictures()[1:3], read_processing(directory))
    tokens, mask = image_rows([[2, 17, "image", 5, 33, "image", 8, 61, 12]], counts)

    def loss(logits, lib):
        logp = lib.nn.log_softmax(logits[:, :-1], -1) if lib is jax else torch.log_softmax(logits[:, :-1], -1)
        picked = logp[0, np.arange(tokens.shape[1] - 1), tokens[0, 1:]]
        return -picked[tokens[0, 1:] != IMAGE].mean()

    out = peft_model(input_ids=torch.from_numpy(tokens), mm_token_type_ids=torch.from_numpy(
        (tokens == IMAGE).astype(np.int64)), **_arrays_as_torch(arrays)).logits
    loss(out, torch).backward()
    theirs = {name.replace(".default", "").replace(".model.language_model.", ".model."): p.grad.numpy()
              for name, p in peft_model.named_parameters() if p.requires_grad}

    def logits(p):
        return GEMMA4.forward(p, vision_params, jnp.asarray(tokens), jnp.asarray(arrays), cfg, vision, method=method)

    np.testing.assert_allclose(logits(with_adapter), out.detach().numpy(), rtol=1e-5, atol=2e-4)
    ours = adapter_state_dict(jax.grad(lambda p: loss(logits(p), jax))(with_adapter), cfg, method)
    assert set(ours) == set(theirs) and len(ours) == 4 * cfg.num_layers
    for name, want in theirs.items():
        assert np.abs(ours[name] - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.full
def test_greedy_decoding_with_images_equals_transformers_generate(saved):
    """20 greedy tokens after a prompt with two images: `vision_language_prefill`, then `kv_cache.decode_step`, the
    same tokens as transformers' `generate`."""
    import torch

    from jaxtune.models.kv_cache import decode_step
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    chosen = [pictures()[0], pictures()[4]]
    arrays, counts = image_arrays(chosen, read_processing(directory))
    tokens, mask = image_rows([[2, 17, "image", 5, "image", 33, 8]], counts)
    n = 20
    with torch.no_grad():
        out = model.generate(**torch_inputs(tokens, mask, chosen), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    want = out[0, tokens.shape[1]:].tolist()
    logits, cache = jax.jit(GEMMA4.prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(tokens), jnp.asarray(arrays), cfg=cfg, vision=vision,
        cache_size=tokens.shape[1] + n)
    step = jax.jit(decode_step, static_argnames=("cfg",))
    ours = []
    for _ in range(n):
        ours.append(int(jnp.argmax(logits[0])))
        logits, cache = step(params, jnp.asarray([ours[-1]]), cache, cfg=cfg)
    assert ours == want and len(set(want)) > 3


@pytest.mark.full
def test_sft_step_through_fine_tune_and_its_adapter_in_peft(saved, tmp_path, capsys):
    """Two LoRA SFT steps on chat records with images through the spine (`fine_tune`); the adapter's keys are PEFT's
    on the VLM's text model, and PEFT loads it onto transformers' Gemma 4 with jaxtune's logits with two images;
    `export_merged` writes the whole VLM, which transformers loads with those logits; the adapter's 8 greedy tokens
    after an image equal the PEFT model's `generate`, and `jaxtune generate --image` prints their text."""
    import shutil

    import torch
    import transformers
    from gemma4_vl_files import IMAGE
    from peft import PeftModel
    from test_vision_train import write_image_data

    from jaxtune.cli import main
    from jaxtune.config import SamplingConfig
    from jaxtune.data.image_examples import image_example
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.families import image_processor
    from jaxtune.run_config import load_run_config
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.export import export_merged
    from jaxtune.train.loop import fine_tune

    directory, _ = saved
    shutil.copytree(directory, tmp_path / "model")
    write_image_data(tmp_path)
    text = "\n".join(["[model]", f'path = "{tmp_path / "model"}"', 'dtype = "float32"', "[method]", 'kind = "lora"',
                      "rank = 4", 'target_modules = ["q_proj", "v_proj"]', "[data]",
                      f'train = "{tmp_path / "data.jsonl"}"', "max_seq_len = 200", "max_images_per_row = 2",
                      "[train]", f'output_dir = "{tmp_path / "lora"}"', "max_steps = 2", "batch_size = 2",
                      "learning_rate = 3e-2", "log_every = 1"])
    (tmp_path / "lora.toml").write_text(text + "\n")
    result = fine_tune(load_run_config(tmp_path / "lora.toml"), log=lambda line: None)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert result.step == 2 and len(losses) == 2 and all(np.isfinite(losses))
    adapter = tmp_path / "lora" / "adapter"
    tokenizer = load_tokenizer(tmp_path / "model")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi?"}]},
                {"role": "assistant", "content": "red."}]
    example = image_example(messages, [pictures()[0], pictures()[2]], image_processor(tmp_path / "model", tokenizer),
                            tokenizer)
    cfg, params, vision, vision_params = load_vision_language_model(tmp_path / "model")
    method, params = load_peft_adapter(adapter, params, cfg)
    ids = np.asarray([example.ids])
    ours = np.asarray(GEMMA4.forward(params, vision_params, jnp.asarray(ids), jnp.asarray(example.pixel_values), cfg,
                                     vision, method=method))
    base = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "model", dtype="float32")
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    assert not [n for n, _ in peft_model.named_parameters() if "lora" in n and "language_model" not in n]
    with torch.no_grad():
        want = peft_model(input_ids=torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy(
            (ids == IMAGE).astype(np.int64)), **_arrays_as_torch(example.pixel_values)).logits.numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=5e-5 * np.abs(want).max())
    merged = export_merged(tmp_path / "model", adapter, tmp_path / "merged")
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(merged, dtype="float32").eval()
    with torch.no_grad():
        again = model(input_ids=torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy(
            (ids == IMAGE).astype(np.int64)), **_arrays_as_torch(example.pixel_values)).logits.numpy()
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=5e-5 * np.abs(want).max())

    prompt, pixels = prompt_ids(image_processor(tmp_path / "model", tokenizer), "Colours?", [pictures()[3]])
    prompt_BxT = np.asarray([prompt])
    with torch.no_grad():
        out = peft_model.generate(input_ids=torch.from_numpy(prompt_BxT), mm_token_type_ids=torch.from_numpy(
            (prompt_BxT == IMAGE).astype(np.int64)), **_arrays_as_torch(pixels), do_sample=False, max_new_tokens=8,
            min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    pictures()[3].save(tmp_path / "p.png")
    main(["generate", "--model", str(tmp_path / "model"), "--adapter", str(adapter), "--prompt", "Colours?",
          "--image", str(tmp_path / "p.png"), "--max-new-tokens", "8"])
    want_ids = out[0, len(prompt):].tolist()
    assert generate_ids_with_images(load_image_generator(tmp_path / "model", adapter), prompt, pixels,
                                    SamplingConfig(max_new_tokens=8)) == want_ids
    eos = next((i for i, t in enumerate(want_ids) if t in (1, 94)), len(want_ids))  # <eos>, <turn|>
    assert capsys.readouterr().out.strip() == tokenizer.decode(want_ids[:eos]).strip()


@pytest.mark.full  # ~40 s cold on the shared 2 cores; the everyday tier plans Qwen2.5-VL's image side
def test_planner_counts_gemma4s_image_side():
    """transformers' default Gemma 4 vision tower (gemma-4-e2b-it's) beside a tiny Gemma 4 text model, LoRA SFT with
    2 images a row of the default 280-token budget on an H100, planned without allocating: the frozen weights hold the
    tower and embedder, and its forward over the padded patches is a moment of its own."""
    import transformers

    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.family import ImageSide
    from jaxtune.models.vision.gemma4 import Gemma4VLConfig, tower_bytes
    from jaxtune.models.vision.gemma4_vision import vision_config_from_hf
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device
    from jaxtune.presets import tiny_model_config

    cfg = tiny_model_config("gemma4")
    vision = Gemma4VLConfig(tower=vision_config_from_hf({"vision_config": transformers.Gemma4VisionConfig().to_dict()},
                                                        cfg.hidden_size))
    shape = GEMMA4.pixel_shape(Gemma4ImageOptions())
    assert shape == (280 * 9, 2 + 3 * 16 * 16)
    plan = TrainPlan(method_config("lora", rank=8), batch_size=2, seq_len=1024)
    with_images = plan.replace(images=ImageSide(GEMMA4, vision, 2, shape))
    text, both = (estimate(cfg, p, get_device("h100")) for p in (plan, with_images))
    tower = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(GEMMA4.param_specs(vision),
                                                               is_leaf=lambda x: isinstance(x, ParamSpec)))
    assert 160e6 < tower < 175e6 and both.frozen_bytes - text.frozen_bytes == 2 * tower
    assert both.phases["image side"]["activations"] == tower_bytes(vision, shape, 2 * 2, 2)


@pytest.mark.full
def test_dpo_with_images_equals_the_dpo_formula_on_transformers_logps(saved, tmp_path):
    """Pairs whose prompts hold an image: DPO's loss on a pair batch (policy: a random PEFT LoRA, reference: the base
    with it off, both reading the images through the frozen image side) equals TRL's sigmoid DPO loss on
    transformers' sequence log-probs of the same ids."""
    import copy

    import torch
    import torch.nn.functional as F
    from gemma4_vl_files import IMAGE
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft
    from test_vision_train import write_image_data, write_preference_data

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows
    from jaxtune.data.image_examples import image_preference_examples
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.families import image_processor, image_side
    from jaxtune.objectives.base import Context, strip_adapters
    from jaxtune.objectives.dpo import PreferenceConfig, _pair_sums, pair_batch
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    peft_model = randomize_peft(get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=GEMMA4.outside_text)))
    peft_model.save_pretrained(tmp_path / "adapter")
    write_image_data(tmp_path)
    write_preference_data(tmp_path)
    tokenizer = load_tokenizer(directory)
    processor = image_processor(directory, tokenizer)
    pairs = list(image_preference_examples(tmp_path / "pairs.jsonl", tokenizer, processor, 200))[:3]
    batch = pair_batch(pairs, 3, 200, images=ImageRows(1, processor.pixel_shape))
    cfg, params, _, vision_params = load_vision_language_model(directory)
    method, policy = load_peft_adapter(tmp_path / "adapter", params, cfg)
    section = PreferenceConfig(beta=0.5)
    ctx = Context(cfg, method, ForwardOptions(), section, images=image_side(directory, 1))
    policy = {**policy, "vision": vision_params}
    loss, count, _ = jax.jit(_pair_sums, static_argnums=3)(policy, strip_adapters(policy), batch, ctx)

    def logp(pair, completion):
        ids = np.asarray([pair.prompt + completion])
        logits = peft_model(input_ids=torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy(
            (ids == IMAGE).astype(np.int64)), **_arrays_as_torch(pair.pixel_values)).logits
        logps = torch.log_softmax(logits[0, :-1], -1).gather(1, torch.from_numpy(ids[0, 1:])[:, None])[:, 0]
        return logps[len(pair.prompt) - 1:].sum()

    want = 0.0
    with torch.no_grad():
        for pair in pairs:
            chosen, rejected = logp(pair, pair.chosen), logp(pair, pair.rejected)
            with peft_model.disable_adapter():
                ref_chosen, ref_rejected = logp(pair, pair.chosen), logp(pair, pair.rejected)
            want += float(-F.logsigmoid(section.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))))
    assert float(count) == 3 and abs(want - 3 * np.log(2)) > 1e-3  # the adapter moves the pairs' margins
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
