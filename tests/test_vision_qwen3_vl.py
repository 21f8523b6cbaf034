"""Qwen3-VL (the `QWEN3_VL` unit, jaxtune/models/vision/qwen3_vl.py; its tower qwen3_vl_vision.py): the released
config read; interleaved M-RoPE's cos/sin equal transformers'; DeepStack enters after the first layers only at the
image's tokens. Full tier, on a tiny random `Qwen3VLForConditionalGeneration` from `save_pretrained` (float32, learned
positions resampled from a 4 x 4 grid, DeepStack from blocks 0 and 2 into 2 of 3 text layers): the image processor
with Qwen3-VL's released settings equals transformers'; logits with one image and with 3 + 1 images, left-padded;
LoRA gradients equal PEFT's; 20 greedy tokens equal `generate`; one SFT and one DPO step through `fine_tune`, the
adapter in PEFT and the merged export in transformers with jaxtune's logits."""

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
