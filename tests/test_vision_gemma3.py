"""Gemma 3's images (jaxtune/models/vision/): the image processor's pixel values equal transformers'
`Gemma3ImageProcessorPil`'s on generated pictures (RGB, RGBA, grayscale, palette; wide, tall, tiny; pan-and-scan);
bidirectional spans in the blockwise attention equal a dense mask's, gradients too; the tower and projector a
float64 numpy computation's; the released config and the hub's tensor names read; and in the full tier
`Gemma3ForConditionalGeneration` from its `save_pretrained`: logits with one image and with several a row (float32,
and float64 to 1e-9), LoRA on the text model against PEFT, greedy decoding with images against `generate`,
transformers 4's tensor names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageDraw

from jaxtune.config.vision import ImageProcessingConfig
from jaxtune.models import attention
from jaxtune.models.attention import blockwise_attention, training_mask
from jaxtune.models.multimodal import PlacedEmbeddings, place_embeddings, span_ids
from jaxtune.models.vision.image_processing import pixel_values, read_image_processing


def pictures(seed: int = 0) -> list[Image.Image]:
    """Photo-like test images: a smooth gradient with noise, shapes on a noisy background with partial transparency,
    a grayscale ramp, a palette image with a transparent colour, a tall and a tiny one."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:61, 0:97]
    gradient = np.stack([x * 2.5, y * 4.0, (x + y) * 1.6], -1) + rng.normal(0, 12, (61, 97, 3))
    rgb = Image.fromarray(np.clip(gradient, 0, 255).astype(np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (80, 120, 4), dtype=np.uint8), "RGBA")
    draw = ImageDraw.Draw(rgba)
    draw.ellipse((10, 10, 70, 60), fill=(250, 30, 40, 180))
    draw.rectangle((60, 20, 110, 75), fill=(20, 200, 90, 255))
    gray = Image.fromarray(np.clip(np.add.outer(np.arange(50) * 5, np.arange(33) * 3), 0, 255).astype(np.uint8), "L")
    palette = Image.fromarray(rng.integers(0, 256, (45, 45, 3), dtype=np.uint8)).convert("P", colors=16)
    palette.info["transparency"] = 3
    tall = Image.fromarray(rng.integers(0, 256, (150, 40, 3), dtype=np.uint8))
    tiny = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    return [rgb, rgba, gray, palette, tall, tiny]


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_pixel_values_equal_transformers_pil_processor(tmp_path, pan_and_scan):
    """Read from the directory transformers' processor saves itself to; the same float32 values, crops and all."""
    import transformers

    kwargs = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=20, pan_and_scan_max_num_crops=3,
                  pan_and_scan_min_ratio_to_activate=1.2) if pan_and_scan else {}
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 42}, image_mean=[0.4, 0.5, 0.6],
                                                     image_std=[0.2, 0.3, 0.25], **kwargs)
    processor.save_pretrained(tmp_path)
    images = pictures()
    want = processor(images=images, return_tensors="np")
    cfg = read_image_processing(tmp_path)
    ours, crops = pixel_values(images, cfg)
    assert ours.dtype == np.float32 and ours.shape == want["pixel_values"].shape
    assert crops == list(want["num_crops"]) and (sum(crops) > 0) == pan_and_scan
    np.testing.assert_array_equal(ours, want["pixel_values"])


def test_pixel_values_of_a_known_image():
    """Without resizing: a 2x2 RGBA picture composited onto white, rescaled and normalised by hand (float64)."""
    rgba = np.array([[[255, 0, 0, 255], [0, 255, 0, 0]], [[0, 0, 255, 128], [10, 20, 30, 255]]], np.uint8)
    cfg = ImageProcessingConfig(height=2, width=2, resize=False, image_mean=(0.5, 0.4, 0.3), image_std=(0.2, 0.5, 1))
    ours, _ = pixel_values([Image.fromarray(rgba, "RGBA")], cfg)
    alpha = rgba[..., 3:] / 255
    rgb = np.round(alpha * rgba[..., :3] + (1 - alpha) * 255)
    want = (np.moveaxis(rgb, -1, 0) / 255 - np.array([0.5, 0.4, 0.3])[:, None, None]) / np.array([0.2, 0.5, 1])[
        :, None, None]
    np.testing.assert_allclose(ours[0], want, atol=1e-6)


# gemma-3-4b-it's config.json as released: its text_config and vision_config name only what differs from the defaults
RELEASED = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255_999,
            "eoi_token_index": 256_000, "eos_token_id": [1, 106], "image_token_index": 262_144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3", "text_config": {
                "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "torch_dtype": "bfloat16", "vision_config": {
                "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


@pytest.mark.reference
def test_released_config_reads_as_transformers_reads_it():
    """The sparse released config gives the same text model as the config transformers fills in and writes out,
    and its image side: 27 layers of 1152, 64 x 64 patches of 14 pixels pooled 4 x 4 to 256 soft tokens; the EOS ids
    are the composite's top-level ones (its text_config has none), as transformers' generation config takes them."""
    import transformers

    from jaxtune.models.hf_config import config_from_hf
    from jaxtune.models.vision.hf import vision_config_from_hf

    filled = transformers.Gemma3Config(**{k: v for k, v in RELEASED.items() if k != "architectures"}).to_dict()
    filled["architectures"] = RELEASED["architectures"]
    cfg = config_from_hf(RELEASED)
    assert cfg == config_from_hf(filled)
    assert (cfg.num_heads, cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (8, 256, 262_208, True)
    assert cfg.eos_token_id == (1, 106)  # the composite's <eos> and <end_of_turn>, which generation stops at
    assert cfg.sliding_windows == ((1024,) * 5 + (0,)) * 5 + (1024,) * 4
    vision = vision_config_from_hf(RELEASED)
    assert vision == vision_config_from_hf(filled)
    assert (vision.tower.num_layers, vision.tower.patches_per_side, vision.pooling, vision.image_token_id) == (
        27, 64, 4, 262_144)


def dense_attention(q, k, v, allowed_BxTxS, scale):
    s = jnp.einsum("bkgqh,bkch->bkgqc", q, k) * scale
    s = jnp.where(allowed_BxTxS[:, None, None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bkgqc,bkch->bkgqh", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("window", [0, 7])
def test_bidirectional_spans_in_blockwise_attention(window, monkeypatch):
    """Two rows of 48 tokens in blocks of 16 (three query and key blocks), images as spans, two across a blocks'
    border: the blockwise kernel's output and gradients equal dense attention under transformers' mask, causal or
    (within the window's reach back) the same image."""
    monkeypatch.setattr(attention, "BLOCK", 16)
    B, K, G, T, hd = 2, 1, 2, 48, 8
    at = np.zeros((B, T), bool)
    at[0, 3:7] = at[0, 8:10] = at[0, 13:20] = at[1, 30:36] = True
    spans = span_ids(jnp.asarray(at))
    assert np.asarray(spans)[0, [2, 3, 6, 7, 8, 13]].tolist() == [-1, 0, 0, -1, 1, 2]
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(
        [(B, K, G, T, hd), (B, K, T, hd), (B, K, T, hd)]))
    mask = training_mask(B, T, 0, None, None, span_ids_BxT=spans)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.asarray(spans)
    same = (s[:, :, None] == s[:, None, :]) & (s[:, :, None] >= 0)
    allowed = ((j <= i) | same) & ((window == 0) | (j > i - window))
    ours = lambda q, k, v: blockwise_attention(q, k, v, mask, window, scale=0.3)  # noqa: E731
    want = lambda q, k, v: dense_attention(q, k, v, jnp.asarray(allowed), 0.3)  # noqa: E731
    np.testing.assert_allclose(ours(q, k, v), want(q, k, v), atol=2e-5)
    cotangent = jax.random.normal(jax.random.key(9), q.shape)
    grads = [jax.vjp(f, q, k, v)[1](cotangent) for f in (ours, want)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_placed_embeddings_replace_marked_rows_in_order():
    x = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    at = jnp.asarray([[False, True, True, False], [True, False, False, False]])
    vectors = -jnp.arange(9, dtype=jnp.float32).reshape(3, 3) - 1
    out = np.asarray(place_embeddings(x, PlacedEmbeddings(vectors, at)))
    np.testing.assert_array_equal(out[at], vectors)
    np.testing.assert_array_equal(out[~np.asarray(at)], np.asarray(x)[~np.asarray(at)])


TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=128,
            rms_norm_eps=1e-5, sliding_window=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# 64-pixel images in 16-pixel patches: a 4 x 4 grid pooled to 2 x 2 soft tokens an image
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=64,
              patch_size=16, vision_use_head=False)
IMAGE, BOI, EOI = 90, 91, 92


def gemma3_vision_language(directory, seed: int = 0):
    """A random tiny Gemma3ForConditionalGeneration saved to `directory` (window 3, under an image's 4 tokens), with
    its processor's settings; the model in float32. SigLIP's LayerNorms scale by their weight: ~1 here."""
    import torch
    import transformers
    from hf_models import randomize

    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                       image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(seed)
    model = randomize(transformers.Gemma3ForConditionalGeneration(config), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.model.vision_tower.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            if name.endswith("patch_embedding.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p[0].numel()))
    model.save_pretrained(directory)
    transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(directory)
    return model.eval()


def image_text(rows: list[list[int | str]]) -> np.ndarray:
    """Token rows where "image" stands for boi, 4 image placeholders, eoi."""
    out = [[t for item in row for t in ([BOI, *[IMAGE] * 4, EOI] if item == "image" else [item])] for row in rows]
    assert len({len(r) for r in out}) == 1
    return np.asarray(out)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("rows", [
    [[2, 17, 5, "image", 33, 8, 61, 12]],
    [[2, "image", "image", 40, 7, "image", 3, 9], [2, *range(11, 23), "image", 23, 24, 25, 26]],
], ids=["one_image", "three_images_a_row"])
def test_logits_equal_gemma3_for_conditional_generation(tmp_path, rows):
    """Read through `load_vision_language_model` from transformers' `save_pretrained`, images processed by
    jaxtune: the soft tokens equal `get_image_features`', the logits transformers' with `token_type_ids`; in float64
    both (`reference.float64_reference`) to 1e-9: the same function."""
    import torch
    from reference import float64_reference

    from jaxtune.config import ForwardOptions
    from jaxtune.models.vision.gemma3 import image_soft_tokens, vision_language_forward
    from jaxtune.spine.model import load_vision_language_model

    model = gemma3_vision_language(tmp_path)
    cfg, params, vision, vision_params = load_vision_language_model(tmp_path)
    tokens = image_text(rows)
    n = int((tokens == IMAGE).sum()) // 4
    pixels, _ = pixel_values(pictures()[:n], read_image_processing(tmp_path))
    with torch.no_grad():
        features = model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
        want = model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                     token_type_ids=torch.tensor(tokens == IMAGE, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(image_soft_tokens(vision_params, jnp.asarray(pixels), vision), features, rtol=1e-5,
                               atol=1e-5)
    run = jax.jit(vision_language_forward, static_argnames=("cfg", "vision", "options"))
    ours = run(params, vision_params, jnp.asarray(tokens), jnp.asarray(pixels), cfg=cfg, vision=vision)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        want = float64_reference(model)(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels).double(),
                                        token_type_ids=torch.tensor(tokens == IMAGE, dtype=torch.long)).logits.numpy()
    with jax.enable_x64(True):
        params, vision_params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, vision_params))
        ours = run(params, vision_params, jnp.asarray(tokens), jnp.asarray(pixels, jnp.float64), cfg=cfg,
                   vision=vision, options=ForwardOptions(compute_dtype="float64"))
        assert np.abs(np.asarray(ours) - want).max() <= 1e-9


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_lora_on_the_language_model_equals_peft(tmp_path):
    """PEFT's LoRA on the text model's q_proj and v_proj (the vision tower's excluded), saved and read by
    `load_peft_adapter` onto the text params: with two images in the row, the logits and d(loss)/d(LoRA A, B)
    equal PEFT's (float32, to 1e-4 of the largest)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft

    from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter
    from jaxtune.models.vision.gemma3 import vision_language_forward
    from jaxtune.spine.model import load_vision_language_model

    model = gemma3_vision_language(tmp_path / "model")
    peft_model = randomize_peft(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 exclude_modules=r".*vision_tower.*")))
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg, params, vision, vision_params = load_vision_language_model(tmp_path / "model")
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    tokens = image_text([[2, 17, "image", 5, 33, "image", 8, 61, 12]])
    pixels, _ = pixel_values(pictures()[:2], read_image_processing(tmp_path / "model"))

    def loss(logits, lib):
        logp = lib.nn.log_softmax(logits[:, :-1], -1) if lib is jax else torch.log_softmax(logits[:, :-1], -1)
        picked = logp[0, np.arange(tokens.shape[1] - 1), tokens[0, 1:]]
        return -picked[tokens[0, 1:] != IMAGE].mean()

    out = peft_model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                     token_type_ids=torch.tensor(tokens == IMAGE, dtype=torch.long)).logits
    loss(out, torch).backward()
    theirs = {name.replace(".default", "").replace(".model.language_model.", ".model."): p.grad.numpy()
              for name, p in peft_model.named_parameters() if p.requires_grad}

    def logits(p):
        return vision_language_forward(p, vision_params, jnp.asarray(tokens), jnp.asarray(pixels), cfg, vision,
                                       method=method)

    np.testing.assert_allclose(logits(with_adapter), out.detach().numpy(), rtol=1e-5, atol=1e-4)
    ours = adapter_state_dict(jax.grad(lambda p: loss(logits(p), jax))(with_adapter), cfg, method)
    assert set(ours) == set(theirs) and len(ours) == 4 * cfg.num_layers
    for name, want in theirs.items():
        assert np.abs(ours[name] - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_greedy_decoding_with_images_equals_transformers_generate(tmp_path):
    """10 greedy tokens after a prompt with two images: `vision_language_prefill` (the images' spans in the cached
    prefill), then `kv_cache.decode_step`, the same tokens as transformers' `generate`."""
    import torch

    from jaxtune.models.kv_cache import decode_step
    from jaxtune.models.vision.gemma3 import vision_language_prefill
    from jaxtune.spine.model import load_vision_language_model

    model = gemma3_vision_language(tmp_path)
    cfg, params, vision, vision_params = load_vision_language_model(tmp_path)
    tokens = image_text([[2, 17, "image", 5, "image", 33, 8]])
    pixels, _ = pixel_values(pictures()[1:3], read_image_processing(tmp_path))
    n = 10
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                             token_type_ids=torch.tensor(tokens == IMAGE, dtype=torch.long), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        last = model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                     token_type_ids=torch.tensor(tokens == IMAGE, dtype=torch.long)).logits[:, -1].numpy()
    want = out[0, tokens.shape[1]:].tolist()
    logits, cache = jax.jit(vision_language_prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(tokens), jnp.asarray(pixels), cfg=cfg, vision=vision,
        cache_size=tokens.shape[1] + n)
    np.testing.assert_allclose(logits, last, rtol=1e-5, atol=1e-4)
    step = jax.jit(decode_step, static_argnames=("cfg",))
    ours = []
    for _ in range(n):
        ours.append(int(jnp.argmax(logits[0])))
        logits, cache = step(params, jnp.asarray([ours[-1]]), cache, cfg=cfg)
    assert ours == want


@pytest.mark.reference
@pytest.mark.parametrize("layout", [
    {"language_model.model.": "language_model.model.", "vision_tower.": "vision_tower.vision_model.",
     "multi_modal_projector.": "multi_modal_projector."},  # as released on the hub
    pytest.param({"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.vision_model.",
                  "multi_modal_projector.": "model.multi_modal_projector."}, marks=pytest.mark.full),  # transformers 4
], ids=["hub", "transformers4"])
def test_every_checkpoint_layout_reads_the_same(tmp_path, layout):
    """The tensors renamed into another layout (and a pooling head jaxtune does not read) load the same trees."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxtune.spine.model import load_vision_language_model

    gemma3_vision_language(tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "renamed")
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    renamed = {next(new + name[len(old):] for old, new in layout.items() if name.startswith(old)): value
               for name, value in tensors.items()}
    renamed[layout["vision_tower."] + "head.probe"] = np.zeros((1, 1, 32), np.float32)
    save_file(renamed, str(tmp_path / "renamed" / "model.safetensors"), metadata={"format": "pt"})
    want, ours = (load_vision_language_model(tmp_path / d) for d in ("saved", "renamed"))
    assert want[0] == ours[0] and want[2] == ours[2]
    for a, b in ((want[1], ours[1]), (want[3], ours[3])):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_image_placeholders_must_match_the_images():
    """Outside jit the placeholders are counted before the tower runs: 8 for one image of 4 soft tokens is named."""
    from jaxtune.config import SiglipConfig, VisionLanguageConfig, tiny_config
    from jaxtune.errors import JaxtuneError
    from jaxtune.models.vision.gemma3 import image_inputs

    tower = SiglipConfig(hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, image_size=16, patch_size=4)
    vision = VisionLanguageConfig(tower=tower, text_hidden_size=64, tokens_per_image=4, image_token_id=7)
    tokens = np.asarray([[1, *[7] * 8, 2]])
    with pytest.raises(JaxtuneError, match="8 image placeholder tokens .id 7. for 1 images of 4 soft tokens"):
        image_inputs({}, tokens, np.zeros((1, 3, 16, 16), np.float32), None, tiny_config(), vision, jnp.float32)


def numpy_soft_tokens(params: dict, pixels: np.ndarray, vision) -> np.ndarray:
    """Gemma 3's image side written out in float64 numpy, a convolution loop and a dense softmax (the everyday tier's
    reference for the tower and the projector)."""
    t, tower = vision.tower, jax.tree.map(lambda a: np.asarray(a, np.float64), params["vision_tower"])
    p, side, N = t.patch_size, t.patches_per_side, pixels.shape[0]
    kernel = tower["patch_embedding"]["kernel"].T.reshape(t.hidden_size, t.num_channels, p, p)
    x = np.stack([np.einsum("dcij,ncij->nd", kernel, pixels[:, :, r * p:(r + 1) * p, c * p:(c + 1) * p])
                  for r in range(side) for c in range(side)], axis=1)
    x = x + tower["patch_embedding"]["bias"] + tower["position_embedding"]

    def norm(x, n):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + t.layer_norm_eps) * n["weight"] + \
            n["bias"]

    for i in range(t.num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], tower["layers"])
        lin = lambda x, name, layer=layer: x @ layer[name]["kernel"] + layer[name]["bias"]  # noqa: E731
        h = norm(x, layer["layer_norm1"])
        q, k, v = (lin(h, f"self_attn.{n}_proj").reshape(N, -1, t.num_heads, t.head_dim) for n in "qkv")
        s = np.einsum("nqhd,nkhd->nhqk", q, k) / np.sqrt(t.head_dim)
        w = np.exp(s - s.max(-1, keepdims=True))
        attended = np.einsum("nhqk,nkhd->nqhd", w / w.sum(-1, keepdims=True), v).reshape(x.shape)
        x = x + lin(attended, "self_attn.out_proj")
        h = lin(norm(x, layer["layer_norm2"]), "mlp.fc1")
        x = x + lin(0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))), "mlp.fc2")
    x = norm(x, tower["post_layernorm"])
    k = vision.pooling
    pooled = x.reshape(N, side // k, k, side // k, k, -1).mean(axis=(2, 4)).reshape(N, -1, x.shape[-1])
    projector = jax.tree.map(lambda a: np.asarray(a, np.float64), params["multi_modal_projector"])
    normed = pooled / np.sqrt((pooled**2).mean(-1, keepdims=True) + t.layer_norm_eps)
    return normed * (1 + projector["mm_soft_emb_norm"]) @ projector["mm_input_projection"]


def test_soft_tokens_equal_a_float64_numpy_tower():
    """A 2-layer tower on 3 images of 24 x 24 pixels (6 x 6 patches of 4, pooled 3 x 3 to 4 soft tokens), random
    weights: jaxtune's float32 soft tokens equal the float64 numpy computation to float32's rounding."""
    from jaxtune.config import SiglipConfig, VisionLanguageConfig
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.gemma3 import image_soft_tokens
    from jaxtune.models.vision.hf import vision_param_specs

    tower = SiglipConfig(hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, image_size=24, patch_size=4)
    vision = VisionLanguageConfig(tower=tower, text_hidden_size=12, tokens_per_image=4, image_token_id=7)
    specs, treedef = jax.tree.flatten(vision_param_specs(vision), is_leaf=lambda x: isinstance(x, ParamSpec))
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(treedef, [rng.normal(1.0 if s.init == "ones" else 0.0, 0.3, s.shape).astype(np.float32)
                                          for s in specs])
    pixels = rng.uniform(-1, 1, (3, 3, 24, 24)).astype(np.float32)
    ours = image_soft_tokens(params, jnp.asarray(pixels), vision)
    assert ours.shape == (3, 4, 12)
    want = numpy_soft_tokens(params, pixels.astype(np.float64), vision)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
