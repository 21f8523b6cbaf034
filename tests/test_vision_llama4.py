"""Llama 4's vision side (issue 52; the `LLAMA4` unit, jaxtune/models/vision/llama4.py) on a tiny random
`Llama4ForConditionalGeneration` (a MoE text model with a chunked and a NoPE layer; `llama4_vl_files.py`): tiles equal
transformers' `Llama4ImageProcessor` (its own code run, only its torchvision resize, pad and normalise swapped for
Pillow's and torch's: no torchvision here) on images of different sizes and aspect ratios; the placeholder text equals
`Llama4Processor`'s; the tower and projector equal transformers'. Full tier: logits with 1 and 3 images, LoRA
gradients against PEFT, 20 greedy tokens against `generate`, SFT through `fine_tune` whose adapter PEFT loads with
jaxtune's logits."""

import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llama4_vl_files import PATCH, write_llama4_model
from PIL import Image

from jaxtune.models.vision.llama4_processor import Llama4ImageOptions, image_tiles

OPTIONS = Llama4ImageOptions(tile_size=16, max_patches=4)
# (height, width): grids 1 x 2, 1 x 2, 3 x 1, 1 x 1, 2 x 2 (downscaled), 1 x 1 (upscaled), 1 x 4
SIZES = [(20, 40), (9, 30), (50, 17), (16, 16), (100, 90), (5, 7), (12, 70)]


def pictures(sizes=SIZES) -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), np.uint8)) for h, w in sizes]


def transformers_image_processor(monkeypatch):
    """transformers' `Llama4ImageProcessor` module, loaded from its file, its class with torchvision's three calls
    (resize: Pillow's bilinear, which torchvision's antialiased uint8 resize follows; pad; normalise in the
    tensor's dtype, as `tvF.normalize`) given in torch."""
    import torch
    import transformers.image_processing_backends  # noqa: F401  (imported before the stand-in below exists)
    import transformers.models.llama4 as package

    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.pad = lambda images, padding, fill: torch.nn.functional.pad(images, (0, padding[2], 0, padding[3]))
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torchvision.transforms.v2"].functional = functional
    monkeypatch.setitem(sys.modules, "torchvision.transforms.v2.functional", functional)
    spec = importlib.util.spec_from_file_location("transformers.models.llama4.image_processing_llama4_reference",
                                                  package.__path__[0] + "/image_processing_llama4.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)

    class Reference(module.Llama4ImageProcessor):
        def resize(self, images, size, resample=None, **kwargs):
            return torch.stack([torch.from_numpy(np.array(Image.fromarray(image.permute(1, 2, 0).numpy()).resize(
                (size.width, size.height), Image.Resampling.BILINEAR))).permute(2, 0, 1) for image in images])

        def normalize(self, images, mean, std, **kwargs):
            return images.sub(torch.as_tensor(mean, dtype=images.dtype)[:, None, None]).div(
                torch.as_tensor(std, dtype=images.dtype)[:, None, None])

    return module, object.__new__(Reference)  # its __init__ asks for torchvision; `_preprocess` reads no state


def test_tiles_grids_padding_and_global_tiles():
    """Torch-free: each image's grid, its tiles then (past one tile) its global tile; a canvas's padding is black
    normalised (-1); values are bfloat16's."""
    tiles, grids = image_tiles(pictures(), OPTIONS)
    assert grids == [(1, 2), (1, 2), (3, 1), (1, 1), (2, 2), (1, 1), (1, 4)]
    assert tiles.shape == (3 + 3 + 4 + 1 + 5 + 1 + 5, 3, 16, 16) and tiles.dtype == np.float32
    np.testing.assert_array_equal(tiles[3, :, 9:], -1.0)  # 9 x 30 is not upscaled on its 16 x 32 canvas
    np.testing.assert_array_equal(tiles[4, :, :, 14:], -1.0)
    np.testing.assert_array_equal(tiles[16, :, 11:], -1.0)  # 5 x 7 is upscaled to 11 x 16, the tile's width
    assert not (tiles[16, :, :11] == -1).any() and not (tiles[:3] == -1).all(axis=(1, 2, 3)).any()
    assert (tiles.astype(jnp.bfloat16).astype(np.float32) == tiles).all()


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_tiles_equal_llama4_image_processor(monkeypatch):
    """Seven images (wide, tall, square, up- and downscaled): the same tiles (global tiles included) in the same
    order, bit for bit (bfloat16 rounding included), and the same grids."""
    import torch

    module, processor = transformers_image_processor(monkeypatch)
    images = pictures()
    want = processor._preprocess(
        [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images], do_resize=True,
        size=module.SizeDict(height=16, width=16), resample=2, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=[0.5] * 3, image_std=[0.5] * 3, max_patches=4, resize_to_max_canvas=False,
        disable_grouping=None, return_tensors=None)
    tiles, grids = image_tiles(images, OPTIONS)
    assert grids == [tuple(g.tolist()) for g in want["aspect_ratios"]]
    assert grids == [(1, 2), (1, 2), (3, 1), (1, 1), (2, 2), (1, 1), (1, 4)]
    np.testing.assert_array_equal(tiles, torch.cat(want["pixel_values"]).float().numpy())


def test_placeholder_ids_of_a_tile_grid(tmp_path):
    """Torch-free: a 1 x 2 grid's ids are `<|image_start|>`, a tile's patches, the column separator, the next tile's,
    the row separator, `<|image|>`, the global tile's, `<|image_end|>`; `<|patch|>` is the config's image token. Its
    3 tiles' placeholders given 2 tiles: one line naming the counts."""
    from llama4_vl_files import IMAGE_END, IMAGE_START, LLAMA4_SPECIAL, LLAMA4_TEXT, LLAMA4_VISION, write_llama4_files

    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.errors import JaxtuneError
    from jaxtune.models.vision.llama4 import LLAMA4
    from jaxtune.models.vision.llama4_vision import vision_config_from_hf

    tokenizer = load_tokenizer(write_llama4_files(tmp_path, template=False))
    vision = vision_config_from_hf({"vision_config": LLAMA4_VISION, "text_config": LLAMA4_TEXT,
                                    "image_token_index": PATCH})
    ids = tokenizer.backend.encode(LLAMA4.expansion(tokenizer, vision, (1, 2)), add_special_tokens=False).ids
    x, y, image = (LLAMA4_SPECIAL[t] for t in ("<|tile_x_separator|>", "<|tile_y_separator|>", "<|image|>"))
    patches = [PATCH] * vision.tokens_per_tile
    assert ids == [IMAGE_START, *patches, x, *patches, y, image, *patches, IMAGE_END]
    with pytest.raises(JaxtuneError, match="12 image placeholder tokens .id 80. for 2 tiles of 4 soft tokens each"):
        LLAMA4.image_inputs({}, jnp.asarray([ids]), jnp.zeros((2, 3, 16, 16)), None, None, vision, jnp.float32)


@pytest.mark.full
@pytest.mark.reference
def test_placeholder_text_equals_llama4_processor(tmp_path):
    """`Llama4Processor.replace_image_token` (its count of patches a tile, its tile separators) for one tile and
    for grids of 1 x 2, 3 x 1 and 2 x 2 tiles; ids through the tokenizer, `<|patch|>` the config's image token."""
    import transformers
    from llama4_vl_files import LLAMA4_TEXT, LLAMA4_VISION, write_llama4_files

    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.models.vision.llama4 import LLAMA4
    from jaxtune.models.vision.llama4_vision import vision_config_from_hf

    reference = object.__new__(transformers.Llama4Processor)
    reference.patch_size, reference.downsample_ratio = 4, 4
    tokenizer = load_tokenizer(write_llama4_files(tmp_path))
    vision = vision_config_from_hf({"vision_config": LLAMA4_VISION, "text_config": LLAMA4_TEXT,
                                    "image_token_index": PATCH})
    assert LLAMA4.marker(tokenizer, vision) == "<|image|>" and vision.tokens_per_tile == 4
    for grid in [(1, 1), (1, 2), (3, 1), (2, 2)]:
        want = reference.replace_image_token({"pixel_values": [np.zeros((3, 16, 16))], "aspect_ratios": [grid]}, 0)
        ours = LLAMA4.expansion(tokenizer, vision, grid)
        assert ours == want
        ids = tokenizer.backend.encode(ours, add_special_tokens=False).ids
        assert ids.count(PATCH) == 4 * (grid[0] * grid[1] + (grid != (1, 1)))


# Llama-4-Scout-17B-16E-Instruct's config.json, its image side (and the text width the projector feeds)
SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080, "eoi_token_index": 200081,
         "image_token_index": 200092,
         "text_config": {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
                         "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
                         "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
                         "attention_chunk_size": 8192},
         "vision_config": {"hidden_size": 1408, "image_size": 336, "intermediate_size": 5632, "num_attention_heads": 16,
                           "num_channels": 3, "num_hidden_layers": 34, "patch_size": 14, "pixel_shuffle_ratio": 0.5,
                           "projector_input_dim": 4096, "projector_output_dim": 4096, "rope_theta": 10000,
                           "vision_output_dim": 4096, "norm_eps": 1e-05, "model_type": "llama4_vision_model"}}


def test_scout_image_side_shapes():
    """Scout's config read; `jax.eval_shape` of its tower on two 336-pixel tiles (nothing allocated): 144 soft
    tokens a tile of the text's width; an inconsistent shuffle width is one line naming the key."""
    from jaxtune.errors import JaxtuneError
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.llama4_vision import param_specs, tile_soft_tokens, vision_config_from_hf

    vision = vision_config_from_hf(SCOUT)
    assert (vision.tokens_per_tile, vision.head_dim, vision.image_token_id, vision.rope_theta) == (144, 88, 200092, 1e4)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), param_specs(vision),
                          is_leaf=lambda x: isinstance(x, ParamSpec))
    assert params["layers"]["mlp.fc1"]["kernel"].shape == (34, 1408, 5632)
    out = jax.eval_shape(lambda p, t: tile_soft_tokens(p, t, vision, jnp.bfloat16), params,
                         jax.ShapeDtypeStruct((2, 3, 336, 336), jnp.float32))
    assert (out.shape, out.dtype) == ((2, 144, 5120), jnp.bfloat16)
    bad = {**SCOUT, "vision_config": {**SCOUT["vision_config"], "intermediate_size": 4096}}
    with pytest.raises(JaxtuneError, match="intermediate_size 4096"):
        vision_config_from_hf(bad)


@pytest.mark.full
@pytest.mark.reference
def test_scout_image_side_counts_as_transformers():
    """Scout's image side as `param_specs` declares it holds as many values as transformers' `Llama4VisionModel` and
    `Llama4MultiModalProjector` built on the meta device (871,932,416), leaf for leaf by shape."""
    import torch
    import transformers

    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.llama4_vision import param_specs, vision_config_from_hf

    config = transformers.Llama4Config(**{k: v for k, v in SCOUT.items() if k != "architectures"})
    with torch.device("meta"):
        modules = [transformers.models.llama4.modeling_llama4.Llama4VisionModel(config.vision_config),
                   transformers.models.llama4.modeling_llama4.Llama4MultiModalProjector(config)]
    theirs = sorted(p.numel() for m in modules for p in m.parameters())
    specs = jax.tree.leaves(param_specs(vision_config_from_hf(SCOUT)), is_leaf=lambda x: isinstance(x, ParamSpec))
    ours = sorted(int(np.prod(s.shape[1:])) for s in specs if len(s.shape) > 1 and s.shape[0] == 34
                  for _ in range(34)) + sorted(int(np.prod(s.shape)) for s in specs
                                               if not (len(s.shape) > 1 and s.shape[0] == 34))
    assert sum(theirs) == sum(ours) == 871_932_416 and sorted(ours) == theirs


def test_planner_counts_the_image_side_of_scout():
    """Scout as released, LoRA SFT with a budget of 5 tiles a row on an H100, planned without allocating: the frozen
    weights hold the tower, adapter and projector (bfloat16) beside the MoE text model, and the tower's forward is a
    moment of its own, its values as `tower_bytes` counts them for the device's rows."""
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.models.hf_config import config_from_hf
    from jaxtune.models.params import ParamSpec
    from jaxtune.models.vision.family import ImageSide
    from jaxtune.models.vision.llama4 import LLAMA4, tower_bytes
    from jaxtune.models.vision.llama4_vision import param_specs, vision_config_from_hf
    from jaxtune.planner import estimate
    from jaxtune.planner.devices import get_device

    cfg, vision = config_from_hf(SCOUT), vision_config_from_hf(SCOUT)
    assert cfg.architecture == "Llama4ForCausalLM" and cfg.num_experts == 16
    plan = TrainPlan(method_config("lora", rank=8), batch_size=2, seq_len=1024)
    with_images = plan.replace(images=ImageSide(LLAMA4, vision, 5, (3, 336, 336)))
    text, both = (estimate(cfg, p, get_device("h100")) for p in (plan, with_images))
    tower = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(param_specs(vision),
                                                               is_leaf=lambda x: isinstance(x, ParamSpec)))
    assert both.frozen_bytes - text.frozen_bytes == 2 * tower
    assert both.phases["image side"]["activations"] == tower_bytes(vision, (3, 336, 336), 2 * 5, 2)
    assert "image side" not in text.phases


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, model): the tiny Llama4ForConditionalGeneration, float32, `save_pretrained` with its tokenizer and
    processor files. transformers 5.24's forward reads `image_outputs` off its language model's output, which has
    none (an AttributeError whenever it runs): a hook gives that output the attribute, empty."""
    directory = tmp_path_factory.mktemp("llama4") / "model"
    model = write_llama4_model(directory)

    def with_image_outputs(module, inputs, output):
        output.image_outputs = None
        return output

    model.language_model.register_forward_hook(with_image_outputs)
    return directory, model


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_tower_and_projector_equal_transformers(saved):
    """`tile_soft_tokens` of eleven tiles (`read_params`' weights) equals transformers' `get_image_features` then
    `multi_modal_projector`, float32."""
    import torch

    from jaxtune.models.vision.llama4_vision import read_config, read_params, tile_soft_tokens

    directory, model = saved
    vision = read_config(directory)
    tiles, _ = image_tiles(pictures()[:4], OPTIONS)
    with torch.no_grad():
        features = model.get_image_features(torch.from_numpy(tiles)).last_hidden_state
        want = model.multi_modal_projector(features).numpy()
    ours = np.asarray(tile_soft_tokens(read_params(directory, vision, jnp.float32), jnp.asarray(tiles), vision))
    assert ours.shape == (11, 4, 32)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def prompt(directory, text: str, images) -> tuple[np.ndarray, np.ndarray]:
    """(ids [1, T], tiles [N, 3, 16, 16]) of `text` whose `<|image|>`s become the processor's text of `images`."""
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.models.vision.families import image_processor

    tokenizer = load_tokenizer(directory)
    tiles, expansions = image_processor(directory, tokenizer)(images)
    pieces = text.split("<|image|>")
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(e + p for e, p in zip(expansions, pieces[1:]))
    return np.array([tokenizer.backend.encode(text, add_special_tokens=False).ids]), tiles


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("sizes", [[(50, 17)], [(20, 40), (16, 16), (100, 90)]], ids=["one_image", "three_images"])
def test_logits_equal_llama4_for_conditional_generation(saved, sizes):
    """Read through `load_vision_language_model`, tiles by jaxtune: the logits of every token (images of several
    tiles across the text's chunks of 8) equal transformers' to ~1e-5 relative."""
    import torch

    from jaxtune.models.vision.families import vision_family
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    ids, tiles = prompt(directory, "<|begin_of_text|>Look: <|image|> then" + "<|image|>" * (len(sizes) - 1) + " ok",
                        pictures(sizes))
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(tiles)).logits.numpy()
    run = jax.jit(vision_family(directory).forward, static_argnames=("cfg", "vision"))
    ours = np.asarray(run(params, vision_params, jnp.asarray(ids), jnp.asarray(tiles), cfg=cfg, vision=vision))
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_lora_gradients_equal_peft(saved, tmp_path):
    """PEFT's LoRA on the text model's q_proj and v_proj (the tower's excluded), read by `load_peft_adapter`: with
    two images, the logits and d(loss)/d(LoRA A, B) equal PEFT's (float32, to 1e-4 of the largest)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from test_methods_peft import randomize_peft

    from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter
    from jaxtune.models.vision.llama4 import vision_language_forward
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    peft_model = randomize_peft(get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=r".*vision_model.*")))
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    ids, tiles = prompt(directory, "<|begin_of_text|>A<|image|>b c<|image|>de", pictures([(20, 40), (9, 30)]))

    def loss(logits, lib):
        logp = lib.nn.log_softmax(logits[:, :-1], -1) if lib is jax else torch.log_softmax(logits[:, :-1], -1)
        picked = logp[0, np.arange(ids.shape[1] - 1), ids[0, 1:]]
        return -picked[ids[0, 1:] != PATCH].mean()

    out = peft_model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(tiles)).logits
    loss(out, torch).backward()
    theirs = {name.replace(".default", "").replace(".language_model.model.", ".model."): p.grad.numpy()
              for name, p in peft_model.named_parameters() if p.requires_grad}

    def logits(p):
        return vision_language_forward(p, vision_params, jnp.asarray(ids), jnp.asarray(tiles), cfg, vision,
                                       method=method)

    np.testing.assert_allclose(logits(with_adapter), out.detach().numpy(), rtol=1e-5, atol=1e-4)
    ours = adapter_state_dict(jax.grad(lambda p: loss(logits(p), jax))(with_adapter), cfg, method)
    assert set(ours) == set(theirs) and len(ours) == 4 * cfg.num_layers
    for name, want in theirs.items():
        assert np.abs(want).max() > 0 and np.abs(ours[name] - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_greedy_decoding_with_images_equals_transformers_generate(saved):
    """20 greedy tokens after a prompt with two images: `LLAMA4.prefill` then `kv_cache.decode_step` give the tokens
    transformers' `generate` gives."""
    import torch

    from jaxtune.models.kv_cache import decode_step
    from jaxtune.models.vision.llama4 import LLAMA4
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    ids, tiles = prompt(directory, "<|begin_of_text|>x<|image|>yz<|image|>", pictures([(12, 70), (50, 17)]))
    n = 20
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(tiles), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    want = out[0, ids.shape[1]:].tolist()
    logits, cache = jax.jit(LLAMA4.prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(ids), jnp.asarray(tiles), cfg=cfg, vision=vision,
        cache_size=ids.shape[1] + n)
    step = jax.jit(decode_step, static_argnames=("cfg",))
    ours = []
    for _ in range(n):
        ours.append(int(jnp.argmax(logits[0])))
        logits, cache = step(params, jnp.asarray([ours[-1]]), cache, cfg=cfg)
    assert ours == want and len(set(ours)) > 1


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_sft_through_fine_tune_and_the_adapter_in_peft(saved, tmp_path):
    """LoRA SFT on chat records with images (tiles padded to a budget of 10 a row) through `fine_tune`: it runs 2
    steps and the loss is finite; its adapter (keys under `language_model.model.`, none on the tower) loads with PEFT
    onto the transformers VLM with jaxtune's logits on a prompt with images; `export_merged` writes the whole VLM,
    which transformers loads with those logits; `generate_ids_with_images` (the chat template's prompt, the adapter
    on, 8 greedy tokens) equals the PEFT model's `generate`."""
    import warnings

    import torch
    import transformers
    from peft import PeftModel
    from safetensors import safe_open
    from test_vision_train import write_image_data

    from jaxtune.config import SamplingConfig
    from jaxtune.image_generation import generate_ids_with_images, load_image_generator, prompt_ids
    from jaxtune.methods.peft import load_peft_adapter
    from jaxtune.models.vision.llama4 import LLAMA4
    from jaxtune.run_config import load_run_config
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.export import export_merged
    from jaxtune.train.loop import fine_tune

    directory = saved[0]
    root = directory.parent
    write_image_data(root, n=4)
    text = "\n".join(["[model]", f'path = "{directory}"', 'dtype = "float32"', "[method]", 'kind = "lora"', "rank = 4",
                      'target_modules = ["q_proj", "v_proj"]', "[data]", f'train = "{root / "data.jsonl"}"',
                      "max_seq_len = 192", "max_images_per_row = 10", "[train]", f'output_dir = "{root / "lora"}"',
                      "max_steps = 2", "batch_size = 2", "learning_rate = 3e-2", "log_every = 1"])
    (root / "lora.toml").write_text(text + "\n")
    result = fine_tune(load_run_config(root / "lora.toml"), log=lambda line: None)
    assert result.step == 2 and np.isfinite(result.train_loss)
    adapter = root / "lora" / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), "np") as f:
        names = sorted(f.keys())
    assert names and all(n.startswith("base_model.model.language_model.model.layers.") for n in names)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        base = transformers.Llama4ForConditionalGeneration.from_pretrained(directory, dtype="float32")
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
    with_image_outputs = lambda module, inputs, output: setattr(output, "image_outputs", None) or output  # noqa
    peft_model.base_model.model.language_model.register_forward_hook(with_image_outputs)
    assert not [n for n, _ in peft_model.named_parameters() if "lora" in n and "language_model" not in n]
    ids, tiles = prompt(directory, "<|begin_of_text|>red<|image|>?", [Image.open(root / "red.png")])
    with torch.no_grad():
        want = peft_model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(tiles)).logits.numpy()
    cfg, params, vision, vision_params = load_vision_language_model(directory)
    method, trained = load_peft_adapter(adapter, params, cfg)
    ours = LLAMA4.forward(trained, vision_params, jnp.asarray(ids), jnp.asarray(tiles), cfg, vision, method=method)
    untrained = LLAMA4.forward(params, vision_params, jnp.asarray(ids), jnp.asarray(tiles), cfg, vision)
    assert np.abs(np.asarray(ours) - np.asarray(untrained)).max() > 1e-3  # the adapter moved the logits
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-4)
    merged = transformers.Llama4ForConditionalGeneration.from_pretrained(
        export_merged(directory, adapter, tmp_path / "merged"), dtype="float32").eval()
    merged.language_model.register_forward_hook(with_image_outputs)
    with torch.no_grad():
        np.testing.assert_allclose(merged(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(tiles)
                                          ).logits.numpy(), want, rtol=1e-5, atol=1e-4)
    generator = load_image_generator(directory, adapter)
    ids, tiles = prompt_ids(generator.processor, "Colours?", [Image.open(root / "red.png"), pictures()[4]])
    ours = generate_ids_with_images(generator, ids, tiles, SamplingConfig(max_new_tokens=8))
    with torch.no_grad():
        out = peft_model.generate(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(tiles), do_sample=False,
                                  max_new_tokens=8, min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(ids):].tolist()
