"""Qwen2.5-VL as a whole model (the `QWEN2_5_VL` unit's forward and prefill, jaxtune/models/vision/qwen2_5_vl.py,
its images padded pixel arrays): the hub's config read; M-RoPE's three equal streams
compute plain RoPE; in the full tier, torch-free, prefill then decode with images equals the whole forward, and
`Qwen2_5_VLForConditionalGeneration` from its `save_pretrained` (float32, windows cut through the images): logits with
one image and with a batch of 3 + 1 images of different sizes, text between, left-padded; LoRA on the text model
against PEFT; 10 greedy tokens with two images against `generate`; the hub's tensor names; text alone as before."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import tiny_config
from jaxtune.errors import JaxtuneError
from jaxtune.models.hf_config import config_from_hf
from jaxtune.models.kv_cache import decode_step
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params
from jaxtune.models.vision.qwen2_5_vl import image_arrays, vision_language_forward, vision_language_prefill
from jaxtune.models.vision.qwen_vl_config import QwenImageOptions, QwenVisionConfig, QwenVLConfig
from jaxtune.models.vision.qwen_vl_processor import image_patches
from jaxtune.models.vision.qwen_vl_vision import abstract_vision_params

IMAGE, VISION_START, VISION_END = 90, 92, 93  # the tiny model's image placeholder and its brackets
MROPE_SECTION = [2, 3, 3]  # of the text's 8 rotary frequencies (head_dim 16)
# patches of 4 pixels, merged 2 x 2, windows of 2 x 2 merged tokens (16 pixels); block 1 of 3 attends fully
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, window_size=16, out_hidden_size=32, fullatt_block_indexes=[1])
OPTIONS = QwenImageOptions(patch_size=4, min_pixels=16 * 16, max_pixels=48 * 64)
# Qwen2.5-VL-3B-Instruct's config.json as the hub holds it (text keys at the top, the older rope_scaling)
RELEASED = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "image_token_id": 151655,
    "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008,
    "max_position_embeddings": 128000, "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}


def test_released_config_reads():
    """The text model a Qwen2 with M-RoPE's sections, the image side its tower and token ids."""
    from jaxtune.models.vision.qwen_vl_config import vision_language_config_from_hf

    cfg = config_from_hf(RELEASED)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (
        "Qwen2ForCausalLM", 2048, 36, 2, 128)
    assert cfg.mrope_section == (16, 24, 24) and cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.qkv_bias and cfg.tie_word_embeddings and cfg.sliding_windows == (0,) * 36
    vision = vision_language_config_from_hf(RELEASED, cfg.hidden_size)
    assert (vision.image_token_id, vision.vision_start_token_id, vision.tower.depth) == (151655, 151652, 32)
    with pytest.raises(JaxtuneError, match="out_hidden_size 2048"):
        vision_language_config_from_hf(RELEASED, 1024)


def pictures() -> list:
    """Five noisy images of different sizes and aspect ratios (grids 8 x 10 to 4 x 4 patches once resized)."""
    from PIL import Image

    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), np.uint8)) for h, w in
            [(60, 100), (91, 37), (20, 300), (64, 64), (140, 45)]]


def plain(mask: np.ndarray) -> jnp.ndarray:
    """Each left-padded row's plain positions, from 0 at its first real token."""
    return jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0))


def arrays_and_grids(images) -> tuple[np.ndarray, np.ndarray]:
    """The unit's pixel arrays of `images` and their grids (t, h, w)."""
    arrays, _ = image_arrays(images, OPTIONS)
    return arrays, np.round(arrays[:, 0, :3]).astype(np.int64)


def image_rows(rows: list[list], grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, T], attention mask [B, T]) of rows where "image" takes the next grid's bracketed placeholders,
    left-padded with 0 to the longest."""
    counts = iter(int(np.prod(g)) // 4 for g in grids)
    out = [[t for item in row for t in ([VISION_START, *[IMAGE] * next(counts), VISION_END] if item == "image"
                                        else [item])] for row in rows]
    T = max(map(len, out))
    tokens, mask = np.zeros((len(out), T), np.int64), np.zeros((len(out), T), np.int64)
    for b, row in enumerate(out):
        tokens[b, T - len(row):], mask[b, T - len(row):] = row, 1
    return tokens, mask


@functools.cache
def tiny_model(seed: int = 0):
    """(cfg, params, vision, vision_params): random, float32, no checkpoint (the everyday tier's)."""
    cfg = tiny_config(vocab_size=96, hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16,
                      architecture="Qwen2ForCausalLM", qkv_bias=True, mrope_section=tuple(MROPE_SECTION))
    tower = QwenVisionConfig(**{k: v for k, v in VISION.items() if k != "fullatt_block_indexes"}, fullatt_blocks=(1,))
    rng = np.random.RandomState(seed)
    vision_params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.randn(*s.shape), s.dtype),
                                 abstract_vision_params(tower))
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(seed))
    return cfg, params, QwenVLConfig(tower=tower, image_token_id=IMAGE), vision_params


def test_equal_streams_are_plain_rope():
    """A text's positions given as three equal M-RoPE streams: the logits of plain positions, to float32 rounding."""
    cfg, params, _, _ = tiny_model()
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 90, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9) + 4, (2, 9))
    run = jax.jit(forward, static_argnames=("cfg",))
    plain = run(params, tokens, cfg, positions_BxT=positions)
    np.testing.assert_allclose(run(params, tokens, cfg, positions_BxT=jnp.stack([positions] * 3)), plain,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.full
def test_prefill_and_decode_with_images_equal_the_forward():
    """Left-padded prompts with 3 + 1 images: `vision_language_prefill` then 3 `decode_step`s give the logits the
    whole forward gives at those tokens (decoding goes on from each row's largest M-RoPE position)."""
    cfg, params, vision, vision_params = tiny_model()
    pixels, grids = arrays_and_grids(pictures()[:4])
    prompt, mask = image_rows([[5, "image", 7, 8, "image", "image", 9], [3, 4, "image", 6]], grids)
    follow = np.array([[11, 12, 13], [21, 22, 23]])
    tokens, full_mask = np.concatenate([prompt, follow], 1), np.concatenate([mask, np.ones_like(follow)], 1)
    whole = jax.jit(vision_language_forward, static_argnames=("cfg", "vision"))(
        params, vision_params, jnp.asarray(tokens), jnp.asarray(pixels), cfg=cfg, vision=vision,
        attention_mask_BxT=jnp.asarray(full_mask), positions_BxT=plain(full_mask))
    logits, cache = jax.jit(vision_language_prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(prompt), jnp.asarray(pixels), cfg=cfg, vision=vision,
        attention_mask_BxT=jnp.asarray(mask), positions_BxT=plain(mask), cache_size=tokens.shape[1])
    T, step = prompt.shape[1], jax.jit(decode_step, static_argnames=("cfg",))
    for i in range(follow.shape[1]):
        np.testing.assert_allclose(logits, whole[:, T - 1 + i], rtol=1e-5, atol=1e-5)
        logits, cache = step(params, jnp.asarray(follow[:, i]), cache, cfg=cfg)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """(directory, model): a tiny random Qwen2_5_VLForConditionalGeneration, float32, saved by `save_pretrained`
    (two text layers, the tower's windows cutting through the images)."""
    import torch
    import transformers
    from hf_models import randomize

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 1e4}),
        vision_config=VISION, image_token_id=IMAGE, video_token_id=91, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen2_5_VLForConditionalGeneration(config), 0)
    with torch.no_grad():
        model.model.visual.merger.ln_q.weight.copy_(1 + 0.1 * torch.randn(32))
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(directory)
    return directory, model.eval()


def torch_inputs(tokens, mask, pixels, grids) -> dict:
    """transformers 5's keyword arguments: its get_rope_index reads the image tokens from `mm_token_type_ids`."""
    import torch

    return dict(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grids),
                mm_token_type_ids=torch.from_numpy((tokens == IMAGE).astype(np.int64)))


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("rows,images", [
    ([[1, 17, 5, "image", 33, 8, 61, 12]], [0]),
    ([[1, "image", 40, "image", 7, 8, "image", 3, 9], [1, *range(11, 17), "image", 23, 24]], [0, 1, 2, 4]),
], ids=["one_image", "three_and_one_images"])
def test_logits_equal_qwen2_5_vl_for_conditional_generation(saved_model, rows, images):
    """Read through `load_vision_language_model`, images processed by jaxtune: the logits of every real token equal
    transformers' to ~1e-5 relative."""
    import torch

    from jaxtune.models.vision.families import vision_family
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved_model
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    assert isinstance(vision, QwenVLConfig) and cfg.mrope_section == tuple(MROPE_SECTION)
    pixels, grids = image_patches([pictures()[i] for i in images], OPTIONS)
    arrays, _ = arrays_and_grids([pictures()[i] for i in images])
    assert len({tuple(g) for g in grids}) == len(grids) and (grids[:, 1:] // 2 % 2).any()  # sizes differ, cut windows
    tokens, mask = image_rows(rows, grids)
    with torch.no_grad():
        want = model(**torch_inputs(tokens, mask, pixels, grids)).logits.numpy()
    run = jax.jit(vision_family(directory).forward, static_argnames=("cfg", "vision"))
    ours = np.asarray(run(params, vision_params, jnp.asarray(tokens), jnp.asarray(arrays), cfg=cfg, vision=vision,
                          attention_mask_BxT=jnp.asarray(mask), positions_BxT=plain(mask)))
    real = mask > 0
    np.testing.assert_allclose(ours[real], want[real], rtol=1e-5, atol=1e-5 * np.abs(want[real]).max())


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_lora_on_the_language_model_equals_peft(saved_model, tmp_path):
    """PEFT's LoRA on the text model's q_proj and v_proj (the tower's excluded), saved and read by
    `load_peft_adapter`: with two images in the row, the logits and d(loss)/d(LoRA A, B) equal PEFT's (float32, to
    1e-4 of the largest)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft

    from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved_model
    peft_model = randomize_peft(get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=r".*visual.*")))
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    pixels, grids = image_patches(pictures()[1:3], OPTIONS)
    tokens, mask = image_rows([[1, 17, "image", 5, 33, "image", 8, 61, 12]], grids)
    images = jnp.asarray(arrays_and_grids(pictures()[1:3])[0])

    def loss(logits, lib):
        logp = lib.nn.log_softmax(logits[:, :-1], -1) if lib is jax else torch.log_softmax(logits[:, :-1], -1)
        picked = logp[0, np.arange(tokens.shape[1] - 1), tokens[0, 1:]]
        return -picked[tokens[0, 1:] != IMAGE].mean()

    out = peft_model(**torch_inputs(tokens, mask, pixels, grids)).logits
    loss(out, torch).backward()
    theirs = {name.replace(".default", "").replace(".model.language_model.", ".model."): p.grad.numpy()
              for name, p in peft_model.named_parameters() if p.requires_grad}

    def logits(p):
        return vision_language_forward(p, vision_params, jnp.asarray(tokens), images, cfg, vision, method=method)

    np.testing.assert_allclose(logits(with_adapter), out.detach().numpy(), rtol=1e-5, atol=1e-4)
    ours = adapter_state_dict(jax.grad(lambda p: loss(logits(p), jax))(with_adapter), cfg, method)
    assert set(ours) == set(theirs) and len(ours) == 4 * cfg.num_layers
    for name, want in theirs.items():
        assert np.abs(ours[name] - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_greedy_decoding_with_images_equals_transformers_generate(saved_model):
    """10 greedy tokens after a prompt with two images: `vision_language_prefill` (M-RoPE positions, the rope
    deltas), then `kv_cache.decode_step`, the same tokens as transformers' `generate`."""
    import torch

    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved_model
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    pixels, grids = image_patches([pictures()[0], pictures()[4]], OPTIONS)
    tokens, mask = image_rows([[1, 17, "image", 5, "image", 33, 8]], grids)
    arrays, _ = arrays_and_grids([pictures()[0], pictures()[4]])
    n = 10
    with torch.no_grad():
        out = model.generate(**torch_inputs(tokens, mask, pixels, grids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    want = out[0, tokens.shape[1]:].tolist()
    logits, cache = jax.jit(vision_language_prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(tokens), jnp.asarray(arrays), cfg=cfg, vision=vision,
        cache_size=tokens.shape[1] + n)
    step = jax.jit(decode_step, static_argnames=("cfg",))
    ours = []
    for _ in range(n):
        ours.append(int(jnp.argmax(logits[0])))
        logits, cache = step(params, jnp.asarray([ours[-1]]), cache, cfg=cfg)
    assert ours == want


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_hub_names_and_text_alone(saved_model, tmp_path):
    """The checkpoint renamed as the hub's releases (`model.layers.*`, `visual.*`, `lm_head.*`, text keys at the top of
    config.json) reads the same; a text alone through `load_model` (the tower's tensors left) or with no images
    gives transformers' logits."""
    import json

    import torch
    from safetensors.numpy import load_file, save_file

    from jaxtune.spine.model import load_model, load_vision_language_model

    directory, model = saved_model
    tensors = load_file(directory / "model.safetensors")
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()},
              tmp_path / "model.safetensors")
    hf = json.loads((directory / "config.json").read_text())
    text = hf.pop("text_config")
    rope = text.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**text, **hf, "rope_theta": rope["rope_theta"], "rope_scaling": {
        "type": "mrope", "mrope_section": rope["mrope_section"]}}))
    assert "visual.patch_embed.proj.weight" in tensors
    loaded = load_vision_language_model(directory)
    renamed = load_vision_language_model(tmp_path)
    assert loaded[0] == renamed[0] and loaded[2] == renamed[2]
    jax.tree.map(np.testing.assert_array_equal, (loaded[1], loaded[3]), (renamed[1], renamed[3]))
    cfg, params = load_model(tmp_path)
    tokens = np.random.RandomState(2).randint(3, 90, (2, 11))
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    for ours in (forward(params, jnp.asarray(tokens), cfg),
                 vision_language_forward(params, loaded[3], jnp.asarray(tokens), None, cfg, loaded[2])):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
