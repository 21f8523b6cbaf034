"""The planner's image side against the compiler: a tiny VLM's step compiled on CPU, `jaxtune plan` on a VLM
directory, and (full tier) the released Qwen2.5-VL-7B and Gemma-3-27B rows of experiments/tpu_compile_table.py as
the TPU compiler compiled them."""

import json
import sys
from pathlib import Path

import pytest
from qwen_vl_files import write_qwen_vl_files

from jaxtune.cli import main
from jaxtune.config import ForwardOptions, MeshConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.models.hf_config import load_config
from jaxtune.models.vision.families import image_side
from jaxtune.planner import estimate
from jaxtune.planner.confirm import compile_step
from jaxtune.planner.devices import get_device

LORA = method_config("lora", rank=4, target_modules=("all-linear",))


def qwen_plan(directory: Path, images: int) -> TrainPlan:
    """The tiny Qwen2.5-VL's float32 LoRA SFT plan: 2 rows of 64 tokens, `images` padded images of 192 patches a
    row."""
    forward = ForwardOptions(compute_dtype="float32", remat="full")
    return TrainPlan(LORA, 2, 64, 1, param_dtype="float32", mesh=MeshConfig(fsdp=1), forward=forward,
                     images=image_side(directory, images))


@pytest.mark.full  # a cold compile of the tiny VLM's step; the plan's image side stays everyday (below)
def test_the_image_side_meets_the_cpu_compile_of_a_tiny_qwen_vl_step(tmp_path):
    """A tiny Qwen2.5-VL whose tower's forward is the step's peak (2 rows x 4 images of 192 patches beside 64 text
    tokens): the planner's arguments (the tower's weights and the pixel arrays among them) equal XLA's, and its peak
    is within 10% of the compiled step's. Without the tower attention's score block (`forward_block_bytes`) it was
    44% under."""
    directory = write_qwen_vl_files(tmp_path)
    cfg, plan = load_config(directory), qwen_plan(directory, 4)
    est, compiled = estimate(cfg, plan, get_device("cpu")), compile_step(cfg, plan)
    assert est.peak_phase == "image side"
    args = est.frozen_bytes + est.trainable_bytes + est.optimizer_bytes + est.batch_bytes
    assert abs(args - compiled.argument_bytes) < 64  # step counters and the RNG key
    text = estimate(cfg, plan.replace(images=None), get_device("cpu"))
    assert est.batch_bytes - text.batch_bytes == 2 * 4 * 193 * 96 * 4  # float32 [rows, images, 1 + 192, 3·2·4²]
    assert abs(est.compiled_bytes / compiled.total_bytes - 1) < 0.10, (est.compiled_bytes, compiled.total_bytes)


def test_plan_on_a_vision_language_directory_counts_and_prints_its_image_side(tmp_path, capsys):
    """`jaxtune plan --model VLM --images N`: the plan holds the image side (N arrays a row; the tower in the frozen
    weights, its forward a moment), the text says so and the JSON names it; a text-only objective has none; the
    decoder's attention is planned as the step runs it (Gemma 3's image spans: the blockwise kernel, not splash);
    fewer than one image a row is one line."""
    from jaxtune.planner.command import make_plan
    from jaxtune.planner.kernels import planned_kernel
    from jaxtune.presets import write_random_vision_model

    vlm = str(write_random_vision_model(tmp_path / "vlm"))
    main(["plan", "--model", vlm, "--target", "v5e-4", "--seq", "128", "--images", "2"])
    text = capsys.readouterr().out
    assert "images: gemma3, 2 pixel array(s) of [3, 64, 64] a row; the frozen tower's" in text
    assert "image side" in text.split("peak in the")[1]
    main(["plan", "--model", vlm, "--target", "v5e-4", "--seq", "128", "--images", "2", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert planned["plan"]["images"] == {"family": "gemma3", "max_images_per_row": 2, "pixel_shape": [3, 64, 64]}
    assert planned["phases"]["image side"]["activations"] > 0
    assert make_plan(model=vlm, target="v5e-4", objective="reward")[1].images is None  # reads no images
    cfg, plan, _ = make_plan(model=vlm, target="v5e-4", seq=256)
    assert planned_kernel(cfg, plan, "tpu", 1, 0, 1) is None  # Gemma 3's images attend both ways: blockwise
    assert planned_kernel(cfg, plan.replace(images=None), "tpu", 1, 0, 1).name == "splash"
    with pytest.raises(JaxtuneError, match=r"^--images 0: a vision-language row holds at least 1 image$"):
        make_plan(model=vlm, target="v5e-4", images=0)


@pytest.mark.full
def test_todays_planner_meets_the_tpu_compiler_on_qwen_vl_and_gemma3_with_images():
    """Qwen2.5-VL-7B (2 images of 1,280 tokens a row) and Gemma-3-27B (2 of 256 at 896 px) LoRA SFT on v5e-8 and
    v6e-8, as the TPU compiler compiled them (experiments/results/tpu_compile_table.json): today's estimate within
    20% of the compiler's bytes a chip (`memory_analysis`) at each; and what the images add, against the same row
    without them, within 10% of what they add to the compiler's buffer assignment (the tower's weights and the pixel
    arrays; Qwen's `memory_analysis` adds half as much, its text-only step's temporaries being the larger)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
    import tpu_compile_table as table

    results = {r["label"]: r for r in json.loads(table.RESULTS.read_text())}
    rows = [row for row in table.ROWS if row[0] in ("qwen2.5-vl-7b", "gemma-3-27b-it")]
    with_images = [row for row in rows if "images" in row[2]]
    assert sorted(row[5] for row in with_images) == ["v5e-8", "v5e-8", "v6e-8", "v6e-8"]
    planned = {}
    for row in rows:
        cfg, plan, device = table.model_and_plan(row)
        assert (plan.images is not None) == ("images" in row[2])
        planned[row] = estimate(cfg, plan, device).compiled_bytes
        assert abs(planned[row] / results[table.label(row)]["compiled_bytes"] - 1) < 0.20, table.label(row)
    texts = [row for row in rows if row not in with_images]
    assert len(texts) == 2
    for text in texts:
        image = next(row for row in with_images if row[0] == text[0] and row[3:] == text[3:])
        added = results[table.label(image)]["assigned_bytes"] - results[table.label(text)]["assigned_bytes"]
        assert abs((planned[image] - planned[text]) / added - 1) < 0.10, (table.label(image), added)
