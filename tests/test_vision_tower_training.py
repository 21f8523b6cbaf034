"""Training the image side (issue 52; `[method] vision_modules`, `methods/vision.py`): the parts a method names train
(LoRA on a tower's linear modules, a projector whole; `kind = "full"` all of them), the rest stays frozen, the
default none. Everyday: the trees the spine builds for Gemma 3 and Qwen2.5-VL, the one-line errors. Full tier, on
tiny models: LoRA gradients on the tower and projector equal transformers + PEFT's, the adapter loads in PEFT with
the same logits; `fine_tune` trains the tower (and by default leaves it as read); a full fine-tune's export carries
the trained tower into transformers."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.errors import ConfigError
from jaxtune.methods import method_config
from jaxtune.methods.vision import add_vision_leaves, trained_parts, vision_mask
from jaxtune.models.params import ParamSpec
from jaxtune.models.vision.gemma3 import GEMMA3
from jaxtune.models.vision.qwen2_5_vl import QWEN2_5_VL
from jaxtune.presets import write_gemma3_files


def _abstract(family, directory) -> dict:
    specs = family.param_specs(family.read_config(directory))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs,
                        is_leaf=lambda x: isinstance(x, ParamSpec))


def _trained_paths(family, directory, method) -> set[str]:
    vision = jax.eval_shape(lambda key: add_vision_leaves(_abstract(family, directory), method, family, key),
                            jax.random.key(0))
    mask = vision_mask(vision, method, family)
    return {"/".join(k.key for k in path) for path, m in jax.tree_util.tree_flatten_with_path(mask)[0] if m}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return write_gemma3_files(tmp_path_factory.mktemp("gemma3"))  # config files only: the trees are abstract


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from qwen_vl_files import write_qwen_vl_files

    return write_qwen_vl_files(tmp_path_factory.mktemp("qwen"))


def test_lora_adapts_the_towers_linears_and_trains_a_projector_whole(gemma3_dir, qwen_dir):
    """LoRA's trainable image-side leaves: A and B of each tower linear module (Gemma 3: 6 a layer, Qwen2.5-VL: 5 a
    block, both stacked), every leaf of the projector; "full" trains every leaf of the parts; the default none."""
    lora = method_config("lora", rank=2, vision_modules=["vision_tower", "multi_modal_projector"])
    paths = _trained_paths(GEMMA3, gemma3_dir, lora)
    assert {p for p in paths if "lora" in p} == {f"vision_tower/layers/{m}/lora_{x}" for x in "ab" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")}
    assert {p for p in paths if "lora" not in p} == {"multi_modal_projector/mm_soft_emb_norm",
                                                     "multi_modal_projector/mm_input_projection"}
    vision = jax.eval_shape(lambda k: add_vision_leaves(_abstract(GEMMA3, gemma3_dir), lora, GEMMA3, k),
                            jax.random.key(0))
    q = vision["vision_tower"]["layers"]["self_attn.q_proj"]
    assert q["lora_a"].shape == (*q["kernel"].shape[:-1], 2) and q["lora_b"].shape == (q["kernel"].shape[0], 2,
                                                                                      q["kernel"].shape[-1])
    full = _trained_paths(GEMMA3, gemma3_dir, method_config("full", vision_modules=["vision_tower"]))
    assert full and all(p.startswith("vision_tower/") for p in full) and "vision_tower/post_layernorm/bias" in full
    assert not _trained_paths(GEMMA3, gemma3_dir, method_config("lora"))  # the default: frozen
    qwen = _trained_paths(QWEN2_5_VL, qwen_dir, method_config("lora", vision_modules=["visual", "visual.merger"]))
    assert {p for p in qwen if "lora" in p} == {f"blocks/{m}/lora_{x}" for x in "ab" for m in (
        "qkv", "proj", "gate_proj", "up_proj", "down_proj")}
    assert {p for p in qwen if "lora" not in p} == {"merger/norm", "merger/fc1/kernel", "merger/fc1/bias",
                                                    "merger/fc2/kernel", "merger/fc2/bias"}


def test_a_name_that_reaches_nothing_is_one_line():
    with pytest.raises(ConfigError, match=r"^vision_modules = \"visual\": reaches nothing in "
                                          r"Gemma3ForConditionalGeneration: its image side's parts are vision_tower, "
                                          r"multi_modal_projector$"):
        trained_parts(method_config("lora", vision_modules=["visual"]), GEMMA3)
    with pytest.raises(ConfigError, match="^vision_modules = .*: is for full, lora and qlora, not ia3$"):
        method_config("ia3", vision_modules=["visual"])
    with pytest.raises(ConfigError, match="^dropout = 0.1: does not go with vision_modules"):
        method_config("lora", vision_modules=["visual"], dropout=0.1)


def _with_random_b(tree: dict, seed: int) -> dict:
    """`tree` with every LoRA B drawn N(0, 0.1²) (zeros would hide A's gradient and the adapter's effect)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, x.shape, x.dtype)
                                        if path[-1].key == "lora_b" else x for (path, x), k in zip(leaves, keys)])


def _peft_gradients(directory, family, batch, max_images: int, method, adapter_dir):
    """(jaxtune's gradient of SFT's summed loss w.r.t. the image side's trained leaves, its text params and image
    side): the text LoRA and the tower's with random B, the adapter written to `adapter_dir` as PEFT's."""
    from jaxtune.config import ForwardOptions
    from jaxtune.methods.peft import save_peft_adapter
    from jaxtune.methods.transform import apply_method, combine, partition
    from jaxtune.models.vision.families import image_side
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.sft import batch_loss
    from jaxtune.spine.model import load_vision_language_model

    cfg, params, config, vision = load_vision_language_model(directory)
    params = _with_random_b(apply_method(params, cfg, method, jax.random.key(0)), 1)
    vision = _with_random_b(add_vision_leaves(vision, method, family, jax.random.key(2)), 3)
    trained, frozen = partition(vision, vision_mask(vision, method, family))
    ctx = Context(cfg, method, ForwardOptions(), images=image_side(directory, max_images))
    grads = jax.jit(jax.grad(lambda t: batch_loss({**params, "vision": combine(t, frozen)}, batch, ctx)[0]))(trained)
    save_peft_adapter(adapter_dir, {**params, "vision": vision}, cfg, method, text_prefix=family.text_prefix,
                      outside=family.outside_text, image_side=(family, config))
    return grads, params, vision


def _peft_model(base, adapter_dir):
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # PEFT's "missing adapter keys", "unexpected keys"
        return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def _check_gradients(model, grads: dict, linears: dict, whole: dict) -> None:
    """PEFT's gradients (after backward) equal jaxtune's: `linears` {PEFT module path with {i}: jaxtune's module
    gradient} (A and B, each layer), `whole` {PEFT parameter name: jaxtune's gradient in torch's layout}."""
    named = dict(model.named_parameters())
    for path, module in linears.items():
        for i in range(module["lora_a"].shape[0]):
            for ours, theirs in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                got = named[f"base_model.model.{path.format(i=i)}.{theirs}.default.weight"].grad.numpy()
                np.testing.assert_allclose(np.asarray(module[ours][i]).T, got, rtol=2e-4, atol=1e-6)
    for name, ours in whole.items():
        np.testing.assert_allclose(np.asarray(ours), named[name].grad.numpy(), rtol=2e-4, atol=1e-6)
        assert np.abs(np.asarray(ours)).max() > 0


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_gemma3_tower_lora_and_projector_gradients_and_logits_equal_peft(tmp_path):
    """LoRA on the text's q_proj, the SigLIP tower's every linear module and Gemma 3's projector trained whole:
    the gradients of one batch's summed loss w.r.t. the tower's A and B and the projector equal transformers +
    PEFT's (the adapter as jaxtune writes it, loaded by `PeftModel.from_pretrained`), and so do the logits."""
    import torch
    from test_vision_train import MESSAGES, _picture, gemma3_run_dir

    from jaxtune.data.batching import ImageRows, epoch_batches
    from jaxtune.data.image_examples import image_example
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.methods.vision import with_lora_scales
    from jaxtune.models.vision.families import image_processor
    from jaxtune.models.vision.gemma3 import vision_language_forward
    from jaxtune.presets import GEMMA3_IMAGE
    from jaxtune.spine.model import load_vision_language_model

    base = gemma3_run_dir(tmp_path / "model")
    tokenizer = load_tokenizer(tmp_path / "model")
    processor = image_processor(tmp_path / "model", tokenizer)
    example = image_example(MESSAGES, [_picture(0), _picture(1)], processor, tokenizer)
    batch, = epoch_batches([example], 1, len(example.ids), 0, 0, images=ImageRows(2, processor.pixel_shape))
    method = method_config("lora", rank=2, alpha=3.0, target_modules=["q_proj"],
                           vision_modules=["vision_tower", "multi_modal_projector"])
    grads, params, vision = _peft_gradients(tmp_path / "model", GEMMA3, batch, 2, method, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["multi_modal_projector"] and "vision_tower" in config["target_modules"]

    model = _peft_model(base.float(), tmp_path / "adapter")
    ids = torch.tensor([example.ids])
    labels = torch.where(torch.tensor([example.loss_mask]) == 1, ids, -100)
    out = model(input_ids=ids, pixel_values=torch.tensor(example.pixel_values), labels=labels,
                token_type_ids=(ids == GEMMA3_IMAGE).long())
    (out.loss * int(sum(example.loss_mask[1:]))).backward()
    layers = grads["vision_tower"]["layers"]
    _check_gradients(model, grads, {f"model.vision_tower.encoder.layers.{{i}}.{name}": layers[name] for name in layers
                              if "lora_a" in layers[name]},
                     {"base_model.model.model.multi_modal_projector.modules_to_save.default."
                      "mm_input_projection_weight": grads["multi_modal_projector"]["mm_input_projection"],
                      "base_model.model.model.multi_modal_projector.modules_to_save.default.mm_soft_emb_norm.weight":
                      grads["multi_modal_projector"]["mm_soft_emb_norm"]})
    cfg, _, vision_cfg, _ = load_vision_language_model(tmp_path / "model")
    ours = vision_language_forward(params, with_lora_scales(vision, method, GEMMA3), jnp.asarray([example.ids]),
                                   jnp.asarray(example.pixel_values), cfg, vision_cfg, method=method)
    np.testing.assert_allclose(np.asarray(ours), out.logits.detach().numpy(), rtol=1e-5, atol=1e-4)
