"""Generation with images in batches (issue 52; `image_generation.py`): prompts, each with its own images, padded to
static shapes and decoded together. Full tier, on a tiny random Gemma 3 (`presets.write_random_vision_model`) and a
tiny Qwen2.5-VL: greedy tokens of a batch equal each prompt's alone and transformers' `generate`, the texts are
theirs in batches of 2; a row that `stop_when` ends stops after its chunk, the others as before."""

import numpy as np
import pytest
from test_vision_qwen_vl_train import SIZES, _hf_inputs, saved  # noqa: F401  (saved: the tiny Qwen2.5-VL fixture)

from jaxtune.config import SamplingConfig
from jaxtune.errors import JaxtuneError
from jaxtune.image_decoding import padded_rows
from jaxtune.presets import GEMMA3_IMAGE


def _picture(seed: int, size=(40, 30)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def test_padded_rows_pad_prompts_left_and_images_per_row():
    """Rows and width in buckets; prompts left-padded; a row's pixel arrays beside it; the rows filling the bucket hold
    one token and no image (no query of theirs attends to nothing)."""
    shape = (3, 2, 2)
    pixels = np.zeros((3, 2, *shape), np.float32)
    pixels[0], pixels[2, 0] = 1.0, 3.0
    tokens, mask, pixels_BxMx = padded_rows([[5, 6, 7], list(range(1, 20)), [9]], pixels)
    assert tokens.shape == (4, 32) and pixels_BxMx.shape == (4, 2, *shape)
    assert tokens[0, -3:].tolist() == [5, 6, 7] and not tokens[0, :-3].any()
    assert mask.sum(axis=1).tolist() == [3, 19, 1, 1] and mask[3, -1] == 1 and not tokens[3].any()
    assert pixels_BxMx[0].min() == 1 and pixels_BxMx[2, 0].min() == 3 and not pixels_BxMx[2, 1].any()
    assert not pixels_BxMx[3].any()


def test_prompt_images_bucket_the_images_a_row_and_empty_prompts_are_refused(tmp_path):
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.image_generation import ImageGenerator, generate_batch_with_images, prompt_images
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.vision.families import image_processor
    from jaxtune.presets import write_gemma3_files

    directory = write_gemma3_files(tmp_path / "m")  # no weights: nothing here reads them
    processor = image_processor(directory, load_tokenizer(directory))
    shape = processor.pixel_shape
    images = prompt_images(processor, [np.ones((3, *shape)), np.zeros((0, *shape)), np.full((1, *shape), 2.0)])
    assert images.side.max_images == 4 and images.pixels.shape == (3, 4, *shape)
    assert images.pixels[0, :3].min() == 1 and not images.pixels[0, 3].any() and not images.pixels[1].any()
    assert images.pixels[2, 0].min() == 2 and not images.pixels[2, 1:].any()
    assert prompt_images(processor, [np.zeros((0, *shape))]).pixels.shape == (1, 0, *shape)
    generator = ImageGenerator(load_config(directory), {}, {}, processor)
    with pytest.raises(JaxtuneError, match="^generation with images needs at least one prompt, each of at least one "
                                           "token$"):
        generate_batch_with_images(generator, [([], np.zeros((0, *shape)))])


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


def test_decoding_with_images_refuses_prefix_tuning_and_a_context_mesh(tmp_path):
    """Image prompts' positions count from their first token, so prefix tuning is one error line; a mesh that splits
    rows over a context axis is `generate`'s refusal."""
    from jaxtune.config import MeshConfig
    from jaxtune.image_decoding import PromptImages, decode_with_images
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.vision.families import image_side
    from jaxtune.parallel import abstract_mesh
    from jaxtune.presets import write_gemma3_files
    from jaxtune.spine.run import traced_on

    directory = write_gemma3_files(tmp_path / "m")  # no weights: both refusals come before any is read
    side = image_side(directory, 1)
    assert side is not None
    decode = lambda params: decode_with_images(params, {}, load_config(directory), [[5, 6]],
                                               PromptImages.of(side, [np.zeros((0, *side.pixel_shape))]),
                                               SamplingConfig(max_new_tokens=2), eos_ids=None)
    with pytest.raises(JaxtuneError, match="^prefix tuning with image prompts: their positions count from each "
                                           "prompt's first token"):
        decode({"layers": {"prefix": {"key": np.zeros((1, 4, 1, 1), np.float32)}}})
    with traced_on(abstract_mesh(MeshConfig(fsdp=1, context=8), 8)), pytest.raises(
            JaxtuneError, match=r"^generation does not split a row over \[mesh\] context = 8"):
        decode({})


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
