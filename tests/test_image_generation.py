"""Generation with images in batches (issue 52; `image_generation.py`): prompts, each with its own images, padded to
static shapes and decoded together. Full tier, on a tiny random Gemma 3 (`presets.write_random_vision_model`) and a
tiny Qwen2.5-VL: greedy tokens of a batch equal each prompt's alone and transformers' `generate`, the texts are
theirs in batches of 2; a row that `stop_when` ends stops after its chunk, the others as before."""

import numpy as np
import pytest
from test_vision_qwen_vl_train import SIZES, _hf_inputs, saved  # noqa: F401  (saved: the tiny Qwen2.5-VL fixture)

from jaxtune.config import SamplingConfig
from jaxtune.errors import JaxtuneError
from jaxtune.image_generation import image_batch
from jaxtune.presets import GEMMA3_IMAGE


def _picture(seed: int, size=(40, 30)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def test_image_batch_pads_prompts_left_and_images_per_row():
    """Rows, width and images a row in buckets; prompts left-padded; a row's images first, zeros after; the rows
    filling the bucket repeat the first prompt and are not live."""
    shape = (3, 2, 2)
    prompts = [([5, 6, 7], np.ones((2, *shape))), (list(range(1, 20)), np.zeros((0, *shape))),
               ([9], np.full((1, *shape), 3.0))]
    batch = image_batch(prompts, shape)
    assert batch.tokens_BxW.shape == (4, 32) and batch.pixels_BxMx.shape == (4, 2, *shape)
    assert batch.tokens_BxW[0, -3:].tolist() == [5, 6, 7] and not batch.tokens_BxW[0, :-3].any()
    assert batch.mask_BxW.sum(axis=1).tolist() == [3, 19, 1, 3]
    assert batch.pixels_BxMx[2, 0].min() == 3 and not batch.pixels_BxMx[2, 1].any()
    assert batch.live_B.tolist() == [True, True, True, False]
    assert image_batch([([1], np.zeros((0, *shape)))], shape).pixels_BxMx.shape == (1, 0, *shape)
    with pytest.raises(JaxtuneError, match="at least one token"):
        image_batch([([], np.zeros((0, *shape)))], shape)


def test_a_prompt_past_the_context_and_missing_image_lists_are_one_line(tmp_path):
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.image_generation import ImageGenerator, generate_batch_with_images, generate_texts_with_images
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.vision.families import image_processor
    from jaxtune.presets import write_gemma3_files

    directory = write_gemma3_files(tmp_path / "m")  # no weights: both refusals come before any is read
    generator = ImageGenerator(load_config(directory), {}, {}, image_processor(directory, load_tokenizer(directory)))
    with pytest.raises(JaxtuneError, match=r"^prompt 1 has 510 tokens with its images: with max_new_tokens=8 it would "
                                           r"pass the model's context of 512 \(max_position_embeddings\)$"):
        generate_batch_with_images(generator, [([5], np.zeros((0, 3, 64, 64))), ([5] * 510, np.zeros((0, 3, 64, 64)))],
                                   SamplingConfig(max_new_tokens=8))
    with pytest.raises(JaxtuneError, match="^2 prompts but 1 image lists: give each prompt its own$"):
        generate_texts_with_images(generator, ["a", "b"], [[]])


QUESTIONS = [("Colours?", 2), ("What is in the picture, in a few words?", 1), ("Hi", 0)]


def _greedy_batch_equals_alone_and_generate(directory, hf_generate, sizes):
    from jaxtune.image_generation import (
        eos_ids,
        generate_batch_with_images,
        generate_ids_with_images,
        generate_texts_with_images,
        load_image_generator,
        prompt_ids,
    )

    generator = load_image_generator(directory)
    images = [[_picture(10 * i + k, sizes[k]) for k in range(n)] for i, (_, n) in enumerate(QUESTIONS)]
    prompts = [prompt_ids(generator.processor, q, own) for (q, _), own in zip(QUESTIONS, images)]
    sampling = SamplingConfig(max_new_tokens=6)
    together = generate_batch_with_images(generator, prompts, sampling)
    assert together == [generate_ids_with_images(generator, ids, pixels, sampling) for ids, pixels in prompts]
    assert together == [hf_generate(ids, pixels) for ids, pixels in prompts]
    assert len({tuple(t) for t in together}) > 1  # the prompts differ
    eos = eos_ids(generator)
    texts = generate_texts_with_images(generator, [q for q, _ in QUESTIONS], images, sampling, batch_rows=2)
    tokenizer = generator.processor.tokenizer
    assert texts == [tokenizer.decode(t[:next((k for k, x in enumerate(t) if x in eos), len(t))],
                                      skip_special_tokens=True) for t in together]
    stopped = generate_batch_with_images(generator, prompts, sampling, stop_when=lambda row, tokens: row == 1,
                                         chunk_steps=2)  # row 1 ends after the first chunk, the others run on
    assert stopped == [together[0], together[1][:2], together[2]]


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_gemma3_batch_with_images_equals_alone_and_transformers_generate(tmp_path):
    import torch
    import transformers

    from jaxtune.presets import write_random_vision_model

    directory = write_random_vision_model(tmp_path / "model")
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory, dtype="float32").eval()

    def hf_generate(ids, pixels):
        tokens = torch.tensor([ids])
        extra = dict(pixel_values=torch.tensor(pixels)) if len(pixels) else {}
        with torch.no_grad():
            out = model.generate(input_ids=tokens, token_type_ids=(tokens == GEMMA3_IMAGE).long(), do_sample=False,
                                 max_new_tokens=6, min_new_tokens=6, pad_token_id=0, eos_token_id=None, **extra)
        return out[0, len(ids):].tolist()

    _greedy_batch_equals_alone_and_generate(directory, hf_generate, [(40, 30), (64, 64)])


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_qwen2_5_vl_batch_with_images_equals_alone_and_transformers_generate(saved):  # noqa: F811
    import torch

    from jaxtune.data.image_examples import ImageExample

    directory, model = saved

    def hf_generate(ids, pixels):
        with torch.no_grad():
            out = model.generate(**_hf_inputs(ImageExample(tuple(ids), (0,) * len(ids), pixels)), do_sample=False,
                                 max_new_tokens=6, min_new_tokens=6, pad_token_id=0, eos_token_id=None)
        return out[0, len(ids):].tolist()

    _greedy_batch_equals_alone_and_generate(directory, hf_generate, SIZES[:2])
