"""Qwen3.5's vision (the `QWEN3_5_VL` unit, jaxtune/models/vision/qwen3_vl.py: Qwen3-VL's tower without DeepStack)
into its text model (Gated DeltaNet and gated attention layers, a quarter of each head rotated, interleaved M-RoPE).
Full tier, on a tiny random `Qwen3_5ForConditionalGeneration` from `save_pretrained` (float32), with Qwen3-VL's
checks (tests/test_vision_qwen3_vl.py's helpers): logits with one image and with 3 + 1 images, left-padded; LoRA
gradients on the attention and Gated DeltaNet projections equal PEFT's; 20 greedy tokens equal `generate`; one SFT
and one DPO step through `fine_tune`, the adapter in PEFT and the merged export in transformers with jaxtune's
logits. Qwen3.5-MoE's image side (`Qwen3_5MoeForConditionalGeneration`, the same tower): its config read (everyday);
logits with images, LoRA gradients and 20 greedy tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen_vl_files import QWEN_IMAGE, QWEN_VISION_END, QWEN_VISION_START, write_qwen_vl_files
from test_vision_qwen3_vl import (
    OPTIONS,
    VISION,
    greedy_decoding_equals_generate,
    grids_of,
    lora_gradients_equal_peft,
    sft_and_dpo_then_peft_and_merged_export,
    torch_inputs,
)
from test_vision_qwen_vl_model import image_rows, pictures, plain

from jaxtune.models.vision.qwen2_5_vl import image_arrays
from jaxtune.models.vision.qwen3_vl import QWEN3_5_VL

# 2 layers: Gated DeltaNet, then gated attention (a quarter of each 32-wide head rotated, interleaved M-RoPE)
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, linear_key_head_dim=8, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
            bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
# the same layers, each MLP a mixture of 4 experts (2 a token) beside a shared expert
MOE_TEXT = dict(TEXT, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                num_experts_per_tok=2)
TOWER = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}  # Qwen3-VL's test tower, no DeepStack
# LoRA on every projection of both kinds of layer (in_proj_b, in_proj_a: one column a value head)
LINEAR_MODULES = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def test_qwen3_5_moe_config_reads_as_qwen3_5s_image_side(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration config.json (model types as transformers writes them): the unit
    `QWEN3_5_VL`, its tower without DeepStack, the text model Qwen3.5-MoE's with interleaved M-RoPE."""
    from jaxtune.models.hf_config import config_from_hf
    from jaxtune.models.vision.families import vision_family
    from jaxtune.models.vision.qwen3_vl import vision_language_config_from_hf

    hf = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "image_token_id": QWEN_IMAGE, "text_config": {**MOE_TEXT, "model_type": "qwen3_5_moe_text"},
          "vision_config": {**TOWER, "model_type": "qwen3_5_moe_vision"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = config_from_hf(hf)
    assert vision_family(tmp_path) is QWEN3_5_VL
    assert cfg.architecture == "Qwen3_5MoeForCausalLM" and cfg.num_experts == 4 and cfg.mrope_interleaved
    assert cfg.mrope_section == (2, 1, 1)
    side = vision_language_config_from_hf(hf, cfg.hidden_size)
    assert side.tower.deepstack_visual_indexes == () and side.image_token_id == QWEN_IMAGE


def save_model(directory, config_class, model_class, text: dict):
    """A tiny random `model_class` (float32) of `text` and the Qwen3-VL test tower without DeepStack, saved with the
    tokenizer and preprocessor files of tests/qwen_vl_files.py into `directory`; returns transformers' model."""
    import torch
    from hf_models import randomize

    config = config_class(text_config=text, vision_config=TOWER, image_token_id=QWEN_IMAGE, video_token_id=91,
                          vision_start_token_id=QWEN_VISION_START, vision_end_token_id=QWEN_VISION_END)
    torch.manual_seed(0)
    model = randomize(model_class(config), 0)
    model.save_pretrained(directory)
    write_qwen_vl_files(directory, config=False)
    return model.eval()


@pytest.fixture(scope="module")
def saved_qwen3_5(tmp_path_factory):
    """(directory, model): a tiny random Qwen3_5ForConditionalGeneration."""
    import transformers

    directory = tmp_path_factory.mktemp("qwen3_5") / "model"
    return directory, save_model(directory, transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration,
                                 TEXT)


@pytest.fixture(scope="module")
def saved_qwen3_5_moe(tmp_path_factory):
    """(directory, model): a tiny random Qwen3_5MoeForConditionalGeneration."""
    import transformers

    directory = tmp_path_factory.mktemp("qwen3_5_moe") / "model"
    return directory, save_model(directory, transformers.Qwen3_5MoeConfig,
                                 transformers.Qwen3_5MoeForConditionalGeneration, MOE_TEXT)


def logits_equal_transformers(directory, model, rows, images):
    """Read through `load_vision_language_model` (the unit `QWEN3_5_VL`, no DeepStack), images processed by
    jaxtune: the logits of every real token of the left-padded `rows` equal transformers' to ~1e-5 relative."""
    import torch

    from jaxtune.models.vision.families import vision_family
    from jaxtune.spine.model import load_vision_language_model

    assert vision_family(directory) is QWEN3_5_VL
    cfg, params, side, vision_params = load_vision_language_model(directory)
    assert side.tower.deepstack_visual_indexes == () and "deepstack" not in vision_params and cfg.mrope_interleaved
    chosen = [pictures()[i] for i in images]
    tokens, mask = image_rows(rows, grids_of(chosen))
    with torch.no_grad():
        want = model(**torch_inputs(tokens, mask, chosen)).logits.numpy()
    run = jax.jit(QWEN3_5_VL.forward, static_argnames=("cfg", "vision"))
    ours = np.asarray(run(params, vision_params, jnp.asarray(tokens), jnp.asarray(image_arrays(chosen, OPTIONS)[0]),
                          cfg=cfg, vision=side, attention_mask_BxT=jnp.asarray(mask), positions_BxT=plain(mask)))
    real = mask > 0
    np.testing.assert_allclose(ours[real], want[real], rtol=1e-5, atol=1e-5 * np.abs(want[real]).max())
    return cfg


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("rows,images", [
    ([[1, 17, 5, "image", 33, 8, 61, 12]], [0]),
    ([[1, "image", 40, "image", 7, 8, "image", 3, 9], [1, *range(11, 17), "image", 23, 24]], [0, 1, 2, 4]),
], ids=["one_image", "three_and_one_images"])
def test_qwen3_5_logits_with_images_equal_transformers(saved_qwen3_5, rows, images):
    """Qwen3.5's image side into its Gated DeltaNet text model: logits with images, left-padded, equal
    transformers'."""
    logits_equal_transformers(*saved_qwen3_5, rows, images)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_moe_logits_with_images_equal_transformers(saved_qwen3_5_moe):
    """Qwen3.5-MoE's image side, the same tower and unit, into its mixture-of-experts text model: logits with
    3 + 1 images, left-padded, equal transformers'."""
    cfg = logits_equal_transformers(*saved_qwen3_5_moe, [
        [1, "image", 40, "image", 7, 8, "image", 3, 9], [1, *range(11, 17), "image", 23, 24]], [0, 1, 2, 4])
    assert cfg.architecture == "Qwen3_5MoeForCausalLM" and cfg.num_experts == 4


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_lora_gradients_equal_peft(saved_qwen3_5, tmp_path):
    """PEFT's LoRA on the gated attention's q_proj, v_proj and every Gated DeltaNet projection (PEFT's names under
    `model.language_model.`): with two images, the logits and LoRA gradients equal PEFT's."""
    lora_gradients_equal_peft(*saved_qwen3_5, QWEN3_5_VL, ["q_proj", "v_proj", *LINEAR_MODULES], 2 + 5, tmp_path)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_greedy_decoding_with_images_equals_transformers_generate(saved_qwen3_5):
    """20 greedy tokens after a prompt with two images through Qwen3.5's unit (prefill: the Gated DeltaNet states
    and the M-RoPE rope deltas; then `decode_step`): transformers' `generate`'s tokens, each step's logits its."""
    greedy_decoding_equals_generate(*saved_qwen3_5, QWEN3_5_VL, 20)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_sft_and_dpo_steps_then_peft_and_merged_export(saved_qwen3_5, tmp_path):
    """One LoRA SFT step and one DPO step with images through `fine_tune` (LoRA on the attention, Gated DeltaNet and
    MLP projections); the adapter in PEFT on `Qwen3_5ForConditionalGeneration` and the merged export (the composite
    config) in transformers give jaxtune's logits; greedy generation with images equals PEFT's."""
    import transformers

    sft_and_dpo_then_peft_and_merged_export(
        saved_qwen3_5[0], QWEN3_5_VL, transformers.Qwen3_5ForConditionalGeneration,
        ["q_proj", "v_proj", *LINEAR_MODULES, "gate_proj", "up_proj", "down_proj"], tmp_path)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_moe_greedy_decoding_with_images_equals_transformers_generate(saved_qwen3_5_moe):
    """Qwen3.5-MoE: 20 greedy tokens after a prompt with two images (the experts routed in prefill and each decode
    step) equal transformers' `generate`'s, each step's logits its."""
    greedy_decoding_equals_generate(*saved_qwen3_5_moe, QWEN3_5_VL, 20)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_moe_lora_gradients_equal_peft(saved_qwen3_5_moe, tmp_path):
    """Qwen3.5-MoE: PEFT's LoRA on q_proj, v_proj and every Gated DeltaNet projection, with two images, through the
    routed experts: the logits and LoRA gradients equal PEFT's."""
    lora_gradients_equal_peft(*saved_qwen3_5_moe, QWEN3_5_VL, ["q_proj", "v_proj", *LINEAR_MODULES], 2 + 5, tmp_path)
