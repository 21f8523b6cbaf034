"""The jaxtune_colours tasks' pictures (issue 52): a circle, square or triangle in red, green, blue or yellow on a
plain grey ground, 64 x 64, drawn with Pillow as experiments/vision_colours.py draws its shapes (without the noise, so
that the files stay small). `colours_image` and `colours_choice_image` are the tasks' `doc_to_image` (lm-eval's
`!function`): the doc's picture, a bad or missing file one line naming the task, doc and image.

    python jaxtune/assets/tasks/jaxtune_colours.py   # draws jaxtune_colours/*.png and jaxtune_colours.jsonl again
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 210, 30)}
SHAPES = ("circle", "square", "triangle")


def picture(colour: str, shape: str, rng: random.Random) -> Image.Image:
    """A 64 x 64 RGB picture of the shape in the colour, of a size and place drawn from `rng`."""
    image = Image.new("RGB", (64, 64), (170, 170, 170))
    size = rng.randint(18, 40)
    x, y = rng.randint(2, 62 - size), rng.randint(2, 62 - size)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif shape == "square":
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=fill)
    return image


def docs(seed: int = 0) -> list[tuple[dict, Image.Image]]:
    """The tasks' docs and pictures: each colour with each shape twice (24), in a seeded order."""
    rng = random.Random(seed)
    pairs = [(colour, shape) for colour in COLOURS for shape in SHAPES for _ in range(2)]
    rng.shuffle(pairs)
    return [({"id": i, "image": f"jaxtune_colours/{i}.png", "shape": shape, "answer": colour,
              "choices": list(COLOURS), "label": list(COLOURS).index(colour)}, picture(colour, shape, rng))
            for i, (colour, shape) in enumerate(pairs)]


def _image(task: str, doc: dict) -> list[Image.Image]:
    """The doc's picture, decoded in full; a ValueError of one line (jaxtune's harness shows it as one) if it is
    missing or broken. Plain Pillow: lm-eval imports this file from the task's folder, outside jaxtune's floors."""
    where = f"task {task}, doc {doc['id']}, image {doc['image']}"
    try:
        image = Image.open(HERE / doc["image"])
        image.load()
    except FileNotFoundError:
        raise ValueError(f"{where}: {HERE / doc['image']} not found") from None
    except (OSError, SyntaxError) as e:  # Pillow's UnidentifiedImageError is an OSError
        raise ValueError(f"{where}: not an image Pillow can read ({type(e).__name__}: {e})") from None
    return [image.convert("RGB")]


def colours_image(doc: dict) -> list[Image.Image]:
    return _image("jaxtune_colours", doc)


def colours_choice_image(doc: dict) -> list[Image.Image]:
    return _image("jaxtune_colours_choice", doc)


if __name__ == "__main__":
    (HERE / "jaxtune_colours").mkdir(exist_ok=True)
    drawn = docs()
    for doc, image in drawn:
        image.save(HERE / doc["image"], optimize=True)
    (HERE / "jaxtune_colours.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc, _ in drawn))
