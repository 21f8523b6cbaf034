"""Qwen3.5's vision (the `QWEN3_5_VL` unit, jaxtune/models/vision/qwen3_vl.py: Qwen3-VL's tower without DeepStack)
into its text model (Gated DeltaNet and gated attention layers, a quarter of each head rotated, interleaved M-RoPE).
Full tier, on a tiny random `Qwen3_5ForConditionalGeneration` from `save_pretrained` (float32): logits with one
image and with 3 + 1 images, left-padded, and 10 greedy tokens with two images equal transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen_vl_files import QWEN_IMAGE, QWEN_VISION_END, QWEN_VISION_START
from test_vision_qwen3_vl import OPTIONS, VISION, grids_of, torch_inputs
from test_vision_qwen_vl_model import image_rows, pictures, plain

from jaxtune.models.vision.qwen2_5_vl import image_arrays


@pytest.fixture(scope="module")
def saved_qwen3_5(tmp_path_factory):
    """(directory, model): a tiny random Qwen3_5ForConditionalGeneration (Gated DeltaNet and gated attention layers,
    a quarter of each head rotated, interleaved M-RoPE; the tower Qwen3-VL's test one without DeepStack)."""
    import torch
    import transformers
    from hf_models import randomize

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, linear_key_head_dim=8, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE,
                                        video_token_id=91, vision_start_token_id=QWEN_VISION_START,
                                        vision_end_token_id=QWEN_VISION_END)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen3_5ForConditionalGeneration(config), 0).eval()
    directory = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(directory)
    return directory, model


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("rows,images", [
    ([[1, 17, 5, "image", 33, 8, 61, 12]], [0]),
    ([[1, "image", 40, "image", 7, 8, "image", 3, 9], [1, *range(11, 17), "image", 23, 24]], [0, 1, 2, 4]),
], ids=["one_image", "three_and_one_images"])
def test_qwen3_5_logits_with_images_equal_transformers(saved_qwen3_5, rows, images):
    """Qwen3.5's image side, Qwen3-VL's tower without DeepStack (the `QWEN3_5_VL` unit), into its text model:
    logits with images, left-padded, equal transformers'."""
    import torch

    from jaxtune.models.vision.families import vision_family
    from jaxtune.models.vision.qwen3_vl import QWEN3_5_VL
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved_qwen3_5
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


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen3_5_greedy_decoding_with_images_equals_transformers_generate(saved_qwen3_5):
    """10 greedy tokens after a prompt with two images through Qwen3.5's unit (prefill: the Gated DeltaNet states
    and the M-RoPE rope deltas; then `decode_step`): transformers' `generate`'s tokens, each step's logits its."""
    import torch

    from jaxtune.models.kv_cache import decode_step
    from jaxtune.models.vision.qwen3_vl import QWEN3_5_VL
    from jaxtune.spine.model import load_vision_language_model

    directory, model = saved_qwen3_5
    cfg, params, side, vision_params = load_vision_language_model(directory)
    chosen = [pictures()[0], pictures()[4]]
    tokens, mask = image_rows([[1, 17, "image", 5, "image", 33, 8]], grids_of(chosen))
    n = 10
    with torch.no_grad():
        out = model.generate(**torch_inputs(tokens, mask, chosen), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    logits, cache = jax.jit(QWEN3_5_VL.prefill, static_argnames=("cfg", "vision", "cache_size"))(
        params, vision_params, jnp.asarray(tokens), jnp.asarray(image_arrays(chosen, OPTIONS)[0]), cfg=cfg,
        vision=side, cache_size=tokens.shape[1] + n)
    step = jax.jit(decode_step, static_argnames=("cfg",))
    ours = []
    for i in range(n):
        expected = out.logits[i][0].numpy()
        np.testing.assert_allclose(logits[0], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        ours.append(int(jnp.argmax(logits[0])))
        logits, cache = step(params, jnp.asarray([ours[-1]]), cache, cfg=cfg)
    assert ours == out.sequences[0, tokens.shape[1]:].tolist()
