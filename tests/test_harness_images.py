"""The harness with images (issue 52; `harness/images.py`, `JaxtuneLM` on a vision-language directory): a request's
images read in full, each failure one line naming the task, doc and image; lm-eval's `<image>` as the family's marker;
the bundled jaxtune_colours tasks' pictures as their script draws them. Full tier, on a tiny random Gemma 3: the
colours task's answers and score equal lm-eval's `hf-multimodal` model's on the same directory, its multiple-choice
twin's log-likelihoods with images equal transformers' (a text task in the same evaluation scored as before);
transformers' `AutoProcessor` reads the preset's directory as it is."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from PIL import Image
from test_vision_qwen_vl_train import saved  # noqa: F401  (the tiny Qwen2.5-VL fixture)

from jaxtune.errors import JaxtuneError
from jaxtune.harness import evaluate_tasks
from jaxtune.harness.images import image_chat, marked_text, request_images
from jaxtune.harness.tasks import BUNDLED, task_specs


def _request(visual, task="t", doc=3) -> Instance:
    return Instance("generate_until", {}, ("<image>Hi", {}, {"visual": visual}), 0, (task, doc, 1))


def test_a_requests_images_are_read_and_a_bad_one_is_one_line(tmp_path):
    """PIL images pass; a path or bytes are read; a missing file, a truncated PNG and a non-image each fail on one
    line naming the task, the doc and the image."""
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    picture.save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) - 100])
    images = request_images(_request([picture, str(tmp_path / "ok.png"), {"bytes": data, "path": None}]))
    assert [np.asarray(i).tolist() for i in images] == [np.asarray(picture).tolist()] * 3
    with pytest.raises(JaxtuneError, match=r"^task colours, doc 7, image 1: .*missing.png not found$"):
        request_images(_request([picture, str(tmp_path / "missing.png")], "colours", 7))
    with pytest.raises(JaxtuneError, match=r"^task t, doc 3, image 0 \(.*cut.png\): not an image Pillow can read"):
        request_images(_request([Image.open(tmp_path / "cut.png")]))
    with pytest.raises(JaxtuneError, match=r"^task t, doc 3, image 0: expected a path, image bytes"):
        request_images(_request([3.5]))


def test_the_image_placeholder_becomes_the_familys_marker():
    """`<image>` -> the marker (what hf-multimodal's `image_string` puts); text a chat template marked passes; a count
    that is not one per image is one line; a chat turn splits at `<image>` into parts, as hf-multimodal's."""
    assert marked_text("<image>What colour?<image>", "<boi>", 2, "w") == "<boi>What colour?<boi>"
    assert marked_text("<start><boi>What?", "<boi>", 1, "w") == "<start><boi>What?"
    with pytest.raises(JaxtuneError, match=r"^task t, doc 3: 1 <image> placeholders in the context for 2 images$"):
        marked_text("<image>Hi", "<boi>", 2, "task t, doc 3")
    chat = image_chat([{"role": "user", "content": "<image>What colour?\n<image>"}, {"role": "assistant",
                                                                                    "content": "Red"}])
    assert chat == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?\n"},
                                                 {"type": "image"}]}, {"role": "assistant", "content": "Red"}]


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_transformers_processor_reads_the_preset_as_it_is(tmp_path):
    """transformers' `AutoProcessor` (what `hf-multimodal` loads) on `write_gemma3_files`' directory, with nothing
    added: a Gemma3Processor with the config's soft tokens an image and the chat template, its ids and pixel values
    for a prompt with a picture jaxtune's."""
    import transformers

    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.image_generation import prompt_ids
    from jaxtune.models.vision.families import image_processor
    from jaxtune.presets import write_gemma3_files

    directory = write_gemma3_files(tmp_path / "model")
    processor = transformers.AutoProcessor.from_pretrained(directory)
    assert type(processor).__name__ == "Gemma3Processor" and processor.image_seq_length == 4
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8))
    ids, pixels = prompt_ids(image_processor(directory, load_tokenizer(directory)), "Colours?", [picture])
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colours?"}]}]
    text = processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    want = processor(text=[text], images=[[picture]], add_special_tokens=False, return_tensors="np")
    assert ids == want["input_ids"][0].tolist()
    np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-6)


def test_the_colour_tasks_pictures_are_what_their_script_draws(tmp_path):
    """The bundled pictures equal `jaxtune_colours.docs()` (24 docs, each colour 6 times); both tasks load with
    their `doc_to_image`; a task copy with a missing and a broken picture fails on one line naming task, doc, image."""
    sys.path.insert(0, str(BUNDLED))
    try:
        import jaxtune_colours
    finally:
        sys.path.remove(str(BUNDLED))
    drawn = jaxtune_colours.docs()
    shipped = [json.loads(line) for line in (BUNDLED / "jaxtune_colours.jsonl").read_text().splitlines()]
    assert [doc for doc, _ in drawn] == shipped
    assert sorted(d["answer"] for d in shipped) == sorted(list(jaxtune_colours.COLOURS) * 6)
    for doc, image in drawn:
        assert np.array_equal(np.asarray(Image.open(BUNDLED / doc["image"]).convert("RGB")), np.asarray(image))
    specs, _ = task_specs(["jaxtune_colours", "jaxtune_colours_choice"])
    assert [np.asarray(i).shape for i in specs[1]["doc_to_image"](shipped[0])] == [(64, 64, 3)]
    for name in ("jaxtune_colours.yaml", "jaxtune_colours.py", "jaxtune_colours.jsonl"):
        shutil.copy(BUNDLED / name, tmp_path / name)
    (tmp_path / "jaxtune_colours").mkdir()
    (tmp_path / "jaxtune_colours/1.png").write_bytes(b"not a png")
    (spec,), _ = task_specs([str(tmp_path / "jaxtune_colours.yaml")])
    with pytest.raises(ValueError, match=r"^task jaxtune_colours, doc 0, image jaxtune_colours/0.png: .* not found$"):
        spec["doc_to_image"](shipped[0])
    with pytest.raises(ValueError, match=r"^task jaxtune_colours, doc 1, image jaxtune_colours/1.png: not an image "
                                         r"Pillow can read \(UnidentifiedImageError"):
        spec["doc_to_image"](shipped[1])
    with pytest.raises(JaxtuneError, match=r"^tasks .*jaxtune_colours.yaml: ValueError: task jaxtune_colours, doc 0, "
                                           r"image jaxtune_colours/0.png: .* not found$"):
        evaluate_tasks(_NeverAsked(), [str(tmp_path / "jaxtune_colours.yaml")], limit=2)


class _NeverAsked(LM):
    """A multimodal lm-eval model that fails the test if a request reaches it."""

    MULTIMODAL = True

    def loglikelihood(self, requests):
        pytest.fail("a request reached the model")

    loglikelihood_rolling = generate_until = loglikelihood


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny random Gemma 3 VLM (its processor_config.json as released Gemma 3 directories hold it)."""
    from jaxtune.presets import write_random_vision_model

    return write_random_vision_model(tmp_path_factory.mktemp("gemma3") / "model")


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_colour_tasks_on_gemma3_equal_hf_multimodal_and_transformers(gemma3, monkeypatch):
    """jaxtune_colours (generate_until with images, batched) answers each doc as lm-eval's hf-multimodal model does
    (`image_string` Gemma 3's `<start_of_image>`; without it hf-multimodal writes `<image_soft_token>`, which
    Gemma3Processor refuses), so the score is the same; jaxtune_colours_choice's log-likelihoods with the picture
    equal transformers' on Gemma3Processor's ids; jaxtune_qa (text) in the same run scores as the text model."""
    import lm_eval
    import torch
    import transformers

    from jaxtune.harness import JaxtuneLM, scores

    for key, value in OFFLINE.items():
        monkeypatch.setitem(os.environ, key, value)
    lm = JaxtuneLM(model=str(gemma3), batch_size=4)
    ours = evaluate_tasks(lm, ["jaxtune_colours", "jaxtune_colours_choice", "jaxtune_qa"], limit=6, log_samples=True)
    specs, manager = task_specs(["jaxtune_colours"])
    theirs = lm_eval.simple_evaluate(
        model="hf-multimodal", model_args={"pretrained": str(gemma3), "dtype": "float32", "device": "cpu",
                                           "image_string": "<start_of_image>"},
        tasks=specs, task_manager=manager, limit=6, batch_size=4, log_samples=True, bootstrap_iters=0)
    answers = lambda results: [s["resps"] for s in sorted(results["samples"]["jaxtune_colours"],  # noqa: E731
                                                          key=lambda s: s["doc_id"])]
    assert answers(ours) == answers(theirs) and len(answers(ours)) == 6
    assert any(a[0][0] for a in answers(ours))  # something generated
    assert scores(ours)["jaxtune_colours/exact_match[strip]"] == scores(theirs)["jaxtune_colours/exact_match[strip]"]

    processor = transformers.AutoProcessor.from_pretrained(gemma3)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3, dtype="float32").eval()
    for sample in ours["samples"]["jaxtune_colours_choice"][:2]:
        doc, context = sample["doc"], sample["arguments"][0][0].replace("<image>", "<start_of_image>")
        image = Image.open(BUNDLED / doc["image"]).convert("RGB")
        base = processor(text=context, images=[image], return_tensors="pt")
        for ((logp, _),), choice in zip(sample["resps"], doc["choices"]):
            whole = processor(text=f"{context} {choice}", images=[image], return_tensors="pt")
            with torch.no_grad():
                logits = model(**whole).logits[0].log_softmax(-1)
            ids, start = whole["input_ids"][0], base["input_ids"].shape[1]
            want = logits[start - 1:-1].gather(-1, ids[start:, None]).sum().item()
            np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-4)
    assert "jaxtune_qa/exact_match[strip]" in scores(ours)


def _fake_chartqa_cache(cache: Path, broken: bool = False) -> None:
    """A prepared `datasets` cache of HuggingFaceM4/ChartQA's test split (the layout `load_dataset` reads offline):
    two Pillow-drawn bar charts with their questions and answers, as the Hub's parquet holds them (broken: the
    second chart's bytes not an image)."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet
    from PIL import ImageDraw

    charts = []
    for left, right in ((40, 20), (10, 50)):
        image = Image.new("RGB", (64, 64), "white")
        draw = ImageDraw.Draw(image)
        draw.rectangle((10, 60 - left, 25, 60), fill="blue")
        draw.rectangle((38, 60 - right, 53, 60), fill="blue")
        charts.append(image)
    if broken:
        charts[1] = {"bytes": b"not a png", "path": "chart_1.png"}
    features = datasets.Features({"image": datasets.Image(), "query": datasets.Value("string"),
                                  "label": datasets.List(datasets.Value("string")),
                                  "human_or_machine": datasets.Value("int64")})
    rows = datasets.Dataset.from_dict({"image": charts, "query": ["Which bar is taller?"] * 2,
                                       "label": [["left"], ["right"]], "human_or_machine": [0, 1]}, features=features)
    rows.to_parquet(str(cache / "test.parquet"))
    builder = Parquet(cache_dir=str(cache / "build"), dataset_name="chart_qa", config_name="default", hash="0" * 16,
                      data_files=DataFilesDict.from_patterns({"test": [str(cache / "test.parquet")]}))
    builder.download_and_prepare()
    (cache / "HuggingFaceM4___chart_qa/default/0.0.0").mkdir(parents=True)
    shutil.move(builder.cache_dir, cache / "HuggingFaceM4___chart_qa/default/0.0.0" / ("0" * 16))


@pytest.mark.full
def test_lm_evals_chartqa_runs_from_a_local_datasets_cache(tmp_path):
    """lm-eval's own chartqa (HuggingFaceM4/ChartQA on the Hub) with its dataset in the local `datasets` cache and the
    Hub off: `python -m jaxtune.harness run --model jaxtune` on a tiny Gemma 3 answers both charts (4 new tokens); a
    chart whose bytes are not an image stops `jaxtune eval` with one line."""
    from jaxtune.presets import write_random_vision_model

    directory = write_random_vision_model(tmp_path / "model", max_position_embeddings=2048)
    (tmp_path / "datasets").mkdir()
    _fake_chartqa_cache(tmp_path / "datasets")
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    out = subprocess.run([sys.executable, "-m", "jaxtune.harness", "run", "--model", "jaxtune", "--model_args",
                          f"model={directory}", "--tasks", "chartqa", "--gen_kwargs", "max_gen_toks=4",
                          "--log_samples", "--output_path", str(tmp_path / "out")], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (written,) = (tmp_path / "out").rglob("results_*.json")
    assert set(json.loads(written.read_text())["results"]) == {"chartqa"}
    (samples,) = (tmp_path / "out").rglob("samples_chartqa_*.jsonl")
    answered = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(s["target"] for s in answered) == ["left", "right"]
    assert all(s["resps"][0][0] for s in answered)
    (tmp_path / "broken").mkdir()
    _fake_chartqa_cache(tmp_path / "broken", broken=True)
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "eval", "--model", str(directory), "--tasks",
                          "chartqa"], env={**env, "HF_DATASETS_CACHE": str(tmp_path / "broken")},
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "jaxtune: error: tasks chartqa: an image in a task's dataset is not one Pillow can read "
        "(UnidentifiedImageError; lm-eval decodes them as it loads the task, before naming a doc)"), out.stderr[-2000:]


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_colour_choices_on_qwen2_5_vl_equal_transformers_logps(saved):  # noqa: F811
    """jaxtune_colours_choice on a tiny Qwen2.5-VL (rows right-padded, each its own picture, M-RoPE from each row's
    start): every choice's log-likelihood equals transformers' forward on the same ids and patches; hf-multimodal
    cannot load this directory here (Qwen2_5_VLProcessor's video half needs torchvision)."""
    import torch
    from test_vision_qwen_vl_train import _hf_inputs

    from jaxtune.data.image_examples import ImageExample
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.harness import JaxtuneLM
    from jaxtune.image_generation import text_ids
    from jaxtune.models.vision.families import image_processor

    directory, model = saved
    results = evaluate_tasks(JaxtuneLM(model=str(directory), batch_size=4), ["jaxtune_colours_choice"], limit=3,
                             log_samples=True)
    processor = image_processor(directory, load_tokenizer(directory))
    for sample in results["samples"]["jaxtune_colours_choice"]:
        context = sample["arguments"][0][0].replace("<image>", "<|image_pad|>")
        image = Image.open(BUNDLED / sample["doc"]["image"]).convert("RGB")
        start = len(text_ids(processor, context, [image])[0])
        for ((logp, _),), choice in zip(sample["resps"], sample["doc"]["choices"]):
            ids, pixels = text_ids(processor, f"{context} {choice}", [image])
            with torch.no_grad():
                logits = model(**_hf_inputs(ImageExample(tuple(ids), (0,) * len(ids), pixels))).logits[0]
            want = logits.log_softmax(-1)[start - 1:-1].gather(-1, torch.tensor(ids[start:])[:, None]).sum().item()
            np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-4)
