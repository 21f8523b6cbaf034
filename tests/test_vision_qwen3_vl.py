"""Qwen3-VL (the `QWEN3_VL` unit, jaxtune/models/vision/qwen3_vl.py; its tower qwen3_vl_vision.py): the released
config read; interleaved M-RoPE's cos/sin equal transformers'; DeepStack enters after the first layers only at the
image's tokens. Full tier, on a tiny random `Qwen3VLForConditionalGeneration` from `save_pretrained` (float32, learned
positions resampled from a 4 x 4 grid, DeepStack from blocks 0 and 2 into 2 of 3 text layers): the image processor
with Qwen3-VL's released settings equals transformers'; logits with one image and with 3 + 1 images, left-padded;
LoRA gradients equal PEFT's; 20 greedy tokens equal `generate`; one SFT and one DPO step through `fine_tune`, the
adapter in PEFT and the merged export in transformers with jaxtune's logits (Qwen3.5's: test_vision_qwen3_5.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen_vl_files import QWEN_IMAGE, QWEN_PROCESSING, QWEN_VISION_END, QWEN_VISION_START, write_qwen_vl_files
from test_vision_qwen_vl_model import image_rows, pictures, plain

from jaxtune.errors import JaxtuneError
from jaxtune.models.hf_config import config_from_hf
from jaxtune.models.vision.qwen2_5_vl import image_arrays
from jaxtune.models.vision.qwen3_vl import QWEN3_VL, Qwen3VLConfig, vision_language_config_from_hf
from jaxtune.models.vision.qwen_vl_config import QwenImageOptions

MROPE_SECTION = [2, 3, 3]  # of the text's 8 rotary frequencies (head_dim 16), interleaved
# patches of 4 pixels, merged 2 x 2; 16 learned positions (a 4 x 4 grid); DeepStack from blocks 0 and 2
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "mrope_interleaved": True,
                             "rope_theta": 1e4})
OPTIONS = QwenImageOptions(**{k: v for k, v in QWEN_PROCESSING.items()})
# Qwen3-VL-2B-Instruct's config.json as transformers 5 writes it (the released values, initializer ranges left out)
RELEASED = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
    "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 2048,
                    "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 262144, "attention_bias": False, "bos_token_id": 151643,
                    "eos_token_id": 151645, "tie_word_embeddings": True,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000, "mrope_interleaved": True,
                                        "mrope_section": [24, 20, 20]}},
    "vision_config": {"model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                      "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "out_hidden_size": 2048, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh"}}
# Qwen3-VL-2B-Instruct's preprocessor_config.json
RELEASED_PROCESSING = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                       "image_processor_type": "Qwen2VLImageProcessorFast"}


def test_released_config_reads():
    """The text model a Qwen3 (q/k norms) with interleaved M-RoPE, the image side its tower with DeepStack."""
    cfg = config_from_hf(RELEASED)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (
        "Qwen3ForCausalLM", 2048, 28, 8, 128)
    assert cfg.qk_norm and cfg.mrope_section == (24, 20, 20) and cfg.mrope_interleaved and cfg.rope_theta == 5e6
    vision = vision_language_config_from_hf(RELEASED, cfg.hidden_size)
    assert vision.tower.deepstack_visual_indexes == (5, 11, 17) and vision.tower.grid_side == 48
    assert (vision.image_token_id, vision.tower.patch_size, vision.tower.depth) == (151655, 16, 24)
    with pytest.raises(JaxtuneError, match="out_hidden_size 2048"):
        vision_language_config_from_hf(RELEASED, 1024)
    with pytest.raises(JaxtuneError, match=r"deepstack_visual_indexes \[5, 30\]"):
        vision_language_config_from_hf({**RELEASED, "vision_config": {
            **RELEASED["vision_config"], "deepstack_visual_indexes": [5, 30]}}, 2048)


@pytest.mark.full
@pytest.mark.parity
@pytest.mark.reference
def test_interleaved_mrope_equals_transformers():
    """Qwen3-VL-2B's rotary shape (head_dim 128, sections 24, 20, 20): `rope.mrope_angles` of three streams far
    apart equals `Qwen3VLTextRotaryEmbedding`'s cos and sin, which read the row and column streams interleaved."""
    import torch
    import transformers
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from jaxtune.config import tiny_config
    from jaxtune.models.rope import mrope_angles

    text = transformers.Qwen3VLTextConfig(**RELEASED["text_config"])
    cfg = tiny_config(head_dim=128, num_heads=2, num_kv_heads=1, rope_theta=5e6, mrope_section=(24, 20, 20),
                      mrope_interleaved=True)
    positions = np.random.RandomState(0).randint(0, 40, (3, 2, 7)) + np.array([0, 50, 900])[:, None, None]
    cos, sin = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions))
    ours = mrope_angles(jnp.asarray(positions), cfg, jnp.float32)
    np.testing.assert_allclose(ours[0], cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(ours[1], sin.numpy(), atol=1e-6)


@pytest.mark.parametrize("kinds", [{}, pytest.param(dict(num_experts=4, experts_per_token=2, expert_size=32,
                                                          dense_layers=(0,)), marks=pytest.mark.full)],
                         ids=["one_kind", "dense_and_mixture_layers"])
def test_deepstack_enters_after_the_first_layers_at_the_image_tokens(kinds):
    """`llama.decoder`'s DeepStack hook on a tiny random 3-layer model (one scan, or layers of two kinds scanned by
    kind): vectors for 2 layers change only the marked tokens and those after them (the others' hidden states exactly
    as without); prefill with them (the cache's hook) gives the forward's last logits."""
    from jaxtune.config import tiny_config
    from jaxtune.models.head import head_logits
    from jaxtune.models.kv_cache import prefill
    from jaxtune.models.llama import decoder
    from jaxtune.models.multimodal import DeepStack
    from jaxtune.models.params import init_params

    cfg = tiny_config(num_layers=3, vocab_size=96, **kinds)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.asarray([[5, 6, 90, 90, 90, 7, 8, 9]])
    deepstack = DeepStack(jnp.asarray(np.random.RandomState(1).randn(2, 3, cfg.hidden_size), jnp.float32),
                          tokens == 90)

    @jax.jit
    def run(params, deepstack):
        hidden = decoder(params, tokens, cfg, deepstack=deepstack)
        return (decoder(params, tokens, cfg), hidden, head_logits(params, hidden[:, -1:], None)[:, 0],
                prefill(params, tokens, cfg, deepstack=deepstack)[0])

    plain_hidden, hidden, last, prefilled = run(params, deepstack)
    changed = np.abs(np.asarray(hidden - plain_hidden))
    assert not changed[0, :2].any() and changed[0, 2:].min() > 1e-4
    np.testing.assert_allclose(prefilled, last, rtol=1e-5, atol=1e-5)


@pytest.mark.parity
@pytest.mark.reference
def test_learned_positions_resample_as_transformers():
    """`position_embeddings` at each padded slot of images of grids 4 x 6, 12 x 4 and 2 x 2 patches (a 4 x 4 learned
    grid up- and downsampled) equals transformers' bilinear taps and weights summed."""
    import torch
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    from jaxtune.models.vision.qwen3_vl_vision import position_embeddings
    from jaxtune.models.vision.qwen_vl_vision import frame_layout

    grids, N = np.asarray([[1, 4, 6], [1, 12, 4], [1, 2, 2]]), 48
    table = np.random.RandomState(0).randn(16, 8).astype(np.float32)
    resample = jax.jit(lambda table, grids: position_embeddings(table, frame_layout(grids, N, 2)[0], grids, 4))
    ours = np.asarray(resample(jnp.asarray(table), jnp.asarray(grids, jnp.int32)))
    index, weights = get_vision_interpolation_indices_and_weights(
        torch.from_numpy(grids), num_grid_per_side=4, mode="bilinear", align_corners=True, spatial_merge_size=2)
    want = (torch.from_numpy(table)[index] * weights[:, :, None]).sum(1).numpy()
    counts = grids.prod(-1)
    np.testing.assert_allclose(np.concatenate([ours[i, :n] for i, n in enumerate(counts)]), want, rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parity
@pytest.mark.reference
def test_image_processor_with_qwen3_vl_settings_equals_transformers():
    """Qwen3-VL-2B's preprocessor_config.json (16-pixel patches, mean and std 0.5, at least 65536 pixels) read by
    the unit: patches and grids of six images of different sizes, aspect ratios and modes equal transformers'
    `Qwen2VLImageProcessorPil` (Qwen3-VL's image processor) with those settings."""
    from test_vision_qwen_vl_parity import generated_images
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from jaxtune.models.vision.qwen_vl_config import image_options_from_hf
    from jaxtune.models.vision.qwen_vl_processor import image_patches

    options = image_options_from_hf(RELEASED_PROCESSING)
    assert (options.patch_size, options.factor, options.mean, options.min_pixels) == (16, 32, (0.5,) * 3, 65536)
    images = generated_images()
    values, grids = image_patches(images, options)
    settings = {k: v for k, v in RELEASED_PROCESSING.items() if k not in ("processor_class", "image_processor_type")}
    want = Qwen2VLImageProcessorPil(**settings)(images, return_tensors="np")
    assert len({tuple(g) for g in grids}) == len(images)
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    np.testing.assert_allclose(values, want["pixel_values"], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, model): a tiny random Qwen3VLForConditionalGeneration, float32, `save_pretrained`, with the
    tokenizer and preprocessor files of tests/qwen_vl_files.py."""
    import torch
    import transformers
    from hf_models import randomize

    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=QWEN_IMAGE,
                                        video_token_id=91, vision_start_token_id=QWEN_VISION_START,
                                        vision_end_token_id=QWEN_VISION_END)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen3VLForConditionalGeneration(config), 0)
    directory = tmp_path_factory.mktemp("qwen3_vl") / "model"
    model.save_pretrained(directory)
    write_qwen_vl_files(directory, config=False)
    return directory, model.eval()


def torch_inputs(tokens, mask, images) -> dict:
    """transformers' keyword arguments: its processor's patches and grids of `images`, `mm_token_type_ids`."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processed = Qwen2VLImageProcessorPil(**QWEN_PROCESSING)(images, return_tensors="pt")
    return dict(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                mm_token_type_ids=torch.from_numpy((tokens == QWEN_IMAGE).astype(np.int64)))


def grids_of(images) -> np.ndarray:
    arrays, _ = image_arrays(images, OPTIONS)
    return np.round(arrays[:, 0, :3]).astype(np.int64)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("rows,images", [
    ([[1, 17, 5, "image", 33, 8, 61, 12]], [0]),
    ([[1, "image", 40, "image", 7, 8, "image", 3, 9], [1, *range(11, 17), "image", 23, 24]], [0, 1, 2, 4]),
], ids=["one_image", "three_and_one_images"])
def test_logits_equal_qwen3_vl_for_conditional_generation(saved, rows, images):
    """Read through `load_vision_language_model`, images processed by jaxtune: the logits of every real token equal
    transformers' to ~1e-5 relative."""
    import torch

    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    assert isinstance(vision, Qwen3VLConfig) and cfg.mrope_interleaved
    chosen = [pictures()[i] for i in images]
    tokens, mask = image_rows(rows, grids_of(chosen))
    with torch.no_grad():
        want = model(**torch_inputs(tokens, mask, chosen)).logits.numpy()
    run = jax.jit(QWEN3_VL.forward, static_argnames=("cfg", "vision"))
    ours = np.asarray(run(params, vision_params, jnp.asarray(tokens), jnp.asarray(image_arrays(chosen, OPTIONS)[0]),
                          cfg=cfg, vision=vision, attention_mask_BxT=jnp.asarray(mask), positions_BxT=plain(mask)))
    real = mask > 0
    np.testing.assert_allclose(ours[real], want[real], rtol=1e-5, atol=1e-5 * np.abs(want[real]).max())


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_lora_gradients_equal_peft(saved, tmp_path):
    """PEFT's LoRA on the text model's q_proj and v_proj (the tower's excluded), saved and read by
    `load_peft_adapter`: with two images in the row, the logits and d(loss)/d(LoRA A, B) equal PEFT's (float32, to
    1e-4 of the largest)."""
    lora_gradients_equal_peft(*saved, QWEN3_VL, ["q_proj", "v_proj"], 2 * 3, tmp_path)


def lora_gradients_equal_peft(directory, model, family, target_modules: list[str], modules: int, tmp_path):
    """PEFT's LoRA (rank 4) on `target_modules` of the text model of transformers' `model` (the tower's excluded),
    saved and read by `load_peft_adapter`: with two images in the row, `family`'s logits and d(loss)/d(LoRA A, B)
    of its `modules` adapted modules equal PEFT's (float32, to 1e-4 of the largest)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft

    from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter
    from jaxtune.spine.model import load_vision_language_model

    peft_model = randomize_peft(get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, target_modules=target_modules, exclude_modules=r".*visual.*")))
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    chosen = pictures()[1:3]
    tokens, mask = image_rows([[1, 17, "image", 5, 33, "image", 8, 61, 12]], grids_of(chosen))
    images = jnp.asarray(image_arrays(chosen, OPTIONS)[0])

    def loss(logits, lib):
        logp = lib.nn.log_softmax(logits[:, :-1], -1) if lib is jax else torch.log_softmax(logits[:, :-1], -1)
        picked = logp[0, np.arange(tokens.shape[1] - 1), tokens[0, 1:]]
        return -picked[tokens[0, 1:] != QWEN_IMAGE].mean()

    out = peft_model(**torch_inputs(tokens, mask, chosen)).logits
    loss(out, torch).backward()
    theirs = {name.replace(".default", "").replace(".model.language_model.", ".model."): p.grad.numpy()
              for name, p in peft_model.named_parameters() if p.requires_grad}

    def logits(p):
        return family.forward(p, vision_params, jnp.asarray(tokens), images, cfg, vision, method=method)

    np.testing.assert_allclose(logits(with_adapter), out.detach().numpy(), rtol=1e-5, atol=1e-4)
    ours = adapter_state_dict(jax.grad(lambda p: loss(logits(p), jax))(with_adapter), cfg, method)
    assert set(ours) == set(theirs) and len(ours) == 2 * modules
    for name, want in theirs.items():
        assert np.abs(ours[name] - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_greedy_decoding_with_images_equals_transformers_generate(saved):
    """20 greedy tokens after a prompt with two images: the unit's prefill (M-RoPE positions, DeepStack, the rope
    deltas), then `kv_cache.decode_step`, the same tokens as transformers' `generate`, each step's logits its
    logits (the tiny model repeats itself: the logits show each step is computed alike)."""
    greedy_decoding_equals_generate(*saved, QWEN3_VL, 20)


def greedy_decoding_equals_generate(directory, model, family, n: int):
    """`n` greedy tokens after a prompt with two images, `family`'s prefill then `kv_cache.decode_step`: the tokens
    of transformers' `model.generate`, each step's logits its logits."""
    import torch

    from jaxtune.models.kv_cache import decode_step
    from jaxtune.spine.model import load_vision_language_model

    cfg, params, vision, vision_params = load_vision_language_model(directory)
    chosen = [pictures()[0], pictures()[4]]
    tokens, mask = image_rows([[1, 17, "image", 5, "image", 33, 8]], grids_of(chosen))
    with torch.no_grad():
        out = model.generate(**torch_inputs(tokens, mask, chosen), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    want = out.sequences[0, tokens.shape[1]:].tolist()
    logits, cache = jax.jit(family.prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(tokens), jnp.asarray(image_arrays(chosen, OPTIONS)[0]), cfg=cfg,
        vision=vision, cache_size=tokens.shape[1] + n)
    step = jax.jit(decode_step, static_argnames=("cfg",))
    ours = []
    for i in range(n):
        expected = out.logits[i][0].numpy()
        np.testing.assert_allclose(logits[0], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        ours.append(int(jnp.argmax(logits[0])))
        logits, cache = step(params, jnp.asarray([ours[-1]]), cache, cfg=cfg)
    assert ours == want


def _run_config(root, objective: str, train: str, steps: int, target_modules: list[str]):
    """LoRA on `target_modules`, `objective` on root/`train`, into root/`objective`."""
    from jaxtune.run_config import load_run_config

    text = "\n".join(["[model]", f'path = "{root / "model"}"', 'dtype = "float32"', "[method]", 'kind = "lora"',
                      "rank = 4", f"target_modules = {json.dumps(target_modules)}",
                      "[data]", f'train = "{root / train}"', "max_seq_len = 160", "max_images_per_row = 2",
                      "[train]", f'objective = "{objective}"', f'output_dir = "{root / objective}"',
                      f"max_steps = {steps}", "batch_size = 2", "learning_rate = 3e-2", "log_every = 1",
                      "eval_every = 0"])
    (root / f"{objective}.toml").write_text(text + "\n")
    return load_run_config(root / f"{objective}.toml")


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_sft_and_dpo_steps_then_peft_and_merged_export(saved, tmp_path):
    """One LoRA SFT step and one DPO step on image records through `fine_tune` (the spine: the tower frozen inside
    the one jitted step, DeepStack into the text); the SFT adapter (keys under `model.language_model.`, none on
    `visual.*`) loads with PEFT onto the transformers VLM with jaxtune's logits, and `export_merged` writes the whole
    VLM, which transformers loads with the same logits; greedy generation with images (as `jaxtune generate
    --image`) equals the PEFT model's `generate`."""
    import transformers

    sft_and_dpo_then_peft_and_merged_export(
        saved[0], QWEN3_VL, transformers.Qwen3VLForConditionalGeneration,
        ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], tmp_path)


def sft_and_dpo_then_peft_and_merged_export(directory, family, hf_class, target_modules: list[str], tmp_path):
    """One LoRA SFT step (on `target_modules`) and one DPO step with images through `fine_tune` from a copy of
    `directory`; the SFT adapter in PEFT on `hf_class` and the merged export in transformers give `family`'s logits;
    8 greedy tokens with images (`generate_ids_with_images`) are the PEFT model's `generate`'s."""
    import shutil
    import warnings

    import torch
    from peft import PeftModel
    from PIL import Image
    from safetensors import safe_open
    from test_vision_train import write_image_data, write_preference_data

    from jaxtune.config import SamplingConfig
    from jaxtune.data.image_examples import image_example
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.families import image_processor
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.export import export_merged
    from jaxtune.train.loop import fine_tune

    root = tmp_path
    shutil.copytree(directory, root / "model")
    write_image_data(root)
    for name, size in zip(("red", "green", "blue"), [(40, 30), (20, 52), (64, 64)]):
        Image.open(root / f"{name}.png").resize(size).save(root / f"{name}.png")
    write_preference_data(root)
    sft = fine_tune(_run_config(root, "sft", "data.jsonl", 1, target_modules), log=lambda _: None)
    dpo = fine_tune(_run_config(root, "dpo", "pairs.jsonl", 1, target_modules), log=lambda _: None)
    assert sft.step == dpo.step == 1 and np.isfinite(sft.train_loss) and np.isfinite(dpo.train_loss)

    adapter = root / "sft" / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), "np") as f:
        names = sorted(f.keys())
    assert names and all(n.startswith("base_model.model.model.language_model.layers.") for n in names)
    tokenizer = load_tokenizer(root / "model")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colours?"},
                                             {"type": "image"}]}, {"role": "assistant", "content": "Red."}]
    chosen = [pictures()[0], pictures()[3]]
    example = image_example(messages, chosen, image_processor(root / "model", tokenizer), tokenizer)
    tokens = np.asarray([example.ids])
    load = hf_class.from_pretrained
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        peft_model = PeftModel.from_pretrained(load(root / "model", dtype="float32"), adapter).eval()
    assert not [n for n, _ in peft_model.named_parameters() if "lora" in n and "language_model" not in n]
    with torch.no_grad():
        want = peft_model(**torch_inputs(tokens, np.ones_like(tokens), chosen)).logits.numpy()
        with peft_model.disable_adapter():
            base = peft_model(**torch_inputs(tokens, np.ones_like(tokens), chosen)).logits.numpy()
    assert np.abs(want - base).max() > 1e-3  # the step trained the adapter
    cfg, params, vision, vision_params = load_vision_language_model(root / "model")
    method, params = load_peft_adapter(adapter, params, cfg)
    ours = family.forward(params, vision_params, jnp.asarray(tokens), jnp.asarray(example.pixel_values), cfg,
                          vision, method=method)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-4)
    merged = export_merged(root / "model", adapter, root / "merged")
    with torch.no_grad():
        exported = load(merged, dtype="float32").eval()(**torch_inputs(tokens, np.ones_like(tokens), chosen)).logits
    np.testing.assert_allclose(exported.numpy(), want, rtol=1e-5, atol=1e-4)
    generator = load_image_generator(root / "model", adapter)
    ids, pixels = prompt_ids(generator.processor, "Colours?", chosen)
    prompt = np.asarray([ids])
    with torch.no_grad():
        out = peft_model.generate(**torch_inputs(prompt, np.ones_like(prompt), chosen), do_sample=False,
                                  max_new_tokens=8, min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    ours = generate_ids_with_images(generator, ids, pixels, SamplingConfig(max_new_tokens=8))
    assert ours == out[0, len(ids):].tolist()


def test_planner_counts_the_image_side_of_qwen3_vl_2b():
    """Qwen3-VL-2B-Instruct as released, LoRA SFT with 2 images a row of a 1024-patch budget on an H100, planned
    without allocating: the frozen weights hold the tower (its DeepStack mergers too) beside the text model, and its
    forward over the padded patches is a moment of its own."""
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.family import ImageSide
    from jaxtune.models.vision.qwen2_5_vl import pixel_shape
    from jaxtune.models.vision.qwen3_vl import tower_bytes
    from jaxtune.models.vision.qwen_vl_config import image_options_from_hf
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device

    cfg = config_from_hf(RELEASED)
    vision = vision_language_config_from_hf(RELEASED, cfg.hidden_size)
    shape = pixel_shape(image_options_from_hf({**RELEASED_PROCESSING, "size": {"longest_edge": 1024 * 16 * 16}}))
    assert shape == (1 + 1024, 3 * 2 * 16 * 16)
    plan = TrainPlan(method_config("lora", rank=8), batch_size=2, seq_len=1024)
    with_images = plan.replace(images=ImageSide(QWEN3_VL, vision, 2, shape))
    text, both = (estimate(cfg, p, get_device("h100")) for p in (plan, with_images))
    specs = jax.tree.leaves(QWEN3_VL.param_specs(vision), is_leaf=lambda x: isinstance(x, ParamSpec))
    deepstack = jax.tree.leaves(QWEN3_VL.param_specs(vision)["deepstack"], is_leaf=lambda x: isinstance(x, ParamSpec))
    tower = sum(int(np.prod(s.shape)) for s in specs)
    assert sum(int(np.prod(s.shape)) for s in deepstack) == 3 * (4096 * 4096 + 4096 * 2048 + 2 * 4096 + 4096 + 2048)
    assert both.frozen_bytes - text.frozen_bytes == 2 * tower
    assert both.phases["image side"]["activations"] == tower_bytes(vision, shape, 2 * 2, 2)
