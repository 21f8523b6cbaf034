"""The vision demo (experiments/vision_colours.py): its pictures show the shape in the colour the record names, its
records are TRL's vision format that jaxtune reads, and (full tier) its quick run goes end to end. The run itself:
experiments/README.md."""

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import vision_colours as demo  # noqa: E402

from jaxtune.data.images import image_parts, record_images  # noqa: E402


def test_pictures_show_their_colour_and_records_read(tmp_path):
    drawn = demo.pictures(12, seed=5, directory=tmp_path / "train")
    assert {d["colour"] for d in drawn} <= set(demo.COLOURS) and len({d["colour"] for d in drawn}) > 1
    path = demo.write_records(tmp_path / "d.jsonl", drawn, [d["colour"] for d in drawn])
    for line, d in zip(path.read_text().splitlines(), drawn):
        record = json.loads(line)
        (image,) = record_images(record, "d.jsonl", tmp_path, image_parts(record["messages"]))
        pixels = np.asarray(image).reshape(-1, 3).astype(int)
        distance = np.abs(pixels[:, None] - np.asarray(list(demo.COLOURS.values()))[None]).sum(-1)
        counts = np.bincount(distance.argmin(1)[distance.min(1) < 30], minlength=4)  # pixels of a shape colour
        assert list(demo.COLOURS)[counts.argmax()] == d["colour"] and counts.max() > 150
        assert record["messages"][1]["content"][0]["text"] == d["colour"]
    image, colour, _ = demo.picture(random.Random(0))
    assert image.size == (64, 64) and colour in demo.COLOURS


@pytest.mark.full
def test_the_quick_demo_runs_end_to_end(tmp_path):
    summary = demo.run(tmp_path, quick=True, log=lambda _: None)
    assert len(summary["answers"]) == demo.QUICK["held_out"] and 0 <= summary["accuracy_after"] <= 1
    assert summary["lora_loss"] and all(np.isfinite(r["loss"]) for r in summary["lora_loss"])
