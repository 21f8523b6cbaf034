"""LoRA SFT teaches a vision-language model to look: "What colour is the shape?" about Pillow-drawn pictures (issue 52).

1. Draw the pictures (seeded, no download): a circle, square or triangle in red, green, blue or yellow, of any size
   and place, on a grey, noisy background; training, and held-out pictures none of the training ones equal.
2. A tiny Gemma 3 vision-language model (`presets.write_random_vision_model`: SigLIP tower and projector, random and
   frozen throughout, a 3-layer text model, a character tokenizer, Gemma 3's chat template), whose text model is
   first fully fine-tuned on the question with the pictures in the prompt but a colour drawn at random as the answer:
   the base model answers with a colour word, and it has learned that the picture says nothing.
3. LoRA SFT (all linear layers of the text model) on the true colours; the held-out accuracy of greedy answers
   (`image_generation.generate_with_images`) before and after, and some answers printed.

    PYTHONPATH=. python experiments/vision_colours.py [--quick] [--out runs/vision_colours]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grpo_tasks as tasks  # noqa: E402  (write_toml, timed_fine_tune)

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 210, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What colour is the shape?"
FULL = dict(train=2000, held_out=100, base_steps=300, lora_steps=1000, batch_size=16, lora_rank=16,
            learning_rate=2e-3)
QUICK = dict(train=64, held_out=8, base_steps=4, lora_steps=4, batch_size=8, lora_rank=8, learning_rate=2e-3)
TEXT = dict(hidden_size=128, intermediate_size=256)  # the text model over presets.GEMMA3_TEXT (3 layers)


def picture(rng: random.Random) -> tuple[Image.Image, str, str]:
    """(a 64 x 64 picture, its shape's colour, the shape)."""
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, 12, (64, 64, 3))
    image = Image.fromarray(np.clip(170 + noise, 0, 255).astype(np.uint8))
    size = rng.randint(18, 40)
    x, y = rng.randint(2, 62 - size), rng.randint(2, 62 - size)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif shape == "square":
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=fill)
    return image, colour, shape


def pictures(n: int, seed: int, directory: Path) -> list[dict]:
    """n pictures saved as PNG files under `directory`, each {"file", "colour", "shape"}."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    found = []
    for i in range(n):
        image, colour, shape = picture(rng)
        image.save(directory / f"{i}.png")
        found.append({"file": f"{directory.name}/{i}.png", "colour": colour, "shape": shape})
    return found


def write_records(path: Path, drawn: list[dict], answers: list[str]) -> Path:
    """TRL's vision chat records: the picture and the question from the user, the answer from the model."""
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]}], "images": [d["file"]]}) + "\n"
        for d, answer in zip(drawn, answers)))
    return path


def accuracy(model: Path, adapter: Path | None, data: Path, held_out: list[dict]) -> tuple[float, list[str]]:
    """The share of held-out pictures whose greedy answer is their colour, and the answers."""
    from jaxtune.config import SamplingConfig
    from jaxtune.image_generation import generate_with_images, load_image_generator

    generator = load_image_generator(model, adapter)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    answers = [generate_with_images(generator, QUESTION, [Image.open(data / d["file"])], sampling).strip()
               for d in held_out]
    return float(np.mean([a == d["colour"] for a, d in zip(answers, held_out)])), answers


def run(out: Path, quick: bool, log=print) -> dict:
    from jaxtune.presets import write_random_vision_model

    size = QUICK if quick else FULL
    started = time.perf_counter()
    data = out / "data"
    train = pictures(size["train"], seed=1, directory=data / "train")
    held_out = pictures(size["held_out"], seed=2, directory=data / "held_out")
    guesses = random.Random(3).choices(list(COLOURS), k=len(train))
    write_records(data / "base.jsonl", train, guesses)
    write_records(data / "train.jsonl", train, [d["colour"] for d in train])
    model = write_random_vision_model(out / "random-init", seed=0, **TEXT)
    common = {"data": {"train": str(data / "base.jsonl"), "max_seq_len": 96, "max_images_per_row": 1},
              "train": {"batch_size": size["batch_size"], "learning_rate": size["learning_rate"], "warmup_steps": 10,
                        "log_every": 10}}

    log(f"[1/3] the base: a tiny Gemma 3 VLM's text model fully fine-tuned on {len(train)} pictures answered with a "
        f"random colour ({size['base_steps']} steps) ...")
    base_config = tasks.write_toml(out / "base.toml", {
        "model": {"path": str(model)}, "method": {"kind": "full"}, **common,
        "train": {**common["train"], "output_dir": str(out / "base"), "max_steps": size["base_steps"]}})
    base, base_seconds, _ = tasks.timed_fine_tune(base_config, log)
    before, answers_before = accuracy(base.result_path, None, data, held_out)
    log(f"      held-out accuracy {before:.2f} (chance 0.25); answers {answers_before[:6]}")

    log(f"[2/3] LoRA SFT (rank {size['lora_rank']}, every linear layer) on the true colours "
        f"({size['lora_steps']} steps) ...")
    lora_config = tasks.write_toml(out / "lora.toml", {
        "model": {"path": str(base.result_path)},
        "method": {"kind": "lora", "rank": size["lora_rank"], "alpha": 2 * size["lora_rank"],
                   "target_modules": ["all-linear"]},
        "data": {**common["data"], "train": str(data / "train.jsonl")},
        "train": {**common["train"], "output_dir": str(out / "lora"), "max_steps": size["lora_steps"]}})
    lora, lora_seconds, records = tasks.timed_fine_tune(lora_config, log)
    after, answers_after = accuracy(base.result_path, lora.result_path, data, held_out)
    log(f"[3/3] held-out accuracy {before:.2f} -> {after:.2f}")
    for d, a, b in list(zip(held_out, answers_before, answers_after))[:8]:
        log(f"      a {d['colour']} {d['shape']}: before {a!r}, after {b!r}")
    losses = [{"step": r["step"], "loss": r["loss"]} for r in records if "loss" in r]
    return {"example": "vision_colours", "quick": quick, "sizes": size, "text_model": TEXT,
            "accuracy_before": before, "accuracy_after": after,
            "answers": [{"colour": d["colour"], "shape": d["shape"], "before": a, "after": b}
                        for d, a, b in zip(held_out, answers_before, answers_after)],
            "lora_loss": losses, "base_seconds": round(base_seconds, 1), "lora_seconds": round(lora_seconds, 1),
            "total_seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, about a minute")
    parser.add_argument("--out", default="runs/vision_colours")
    parser.add_argument("--results", default=str(HERE / "results"))
    args = parser.parse_args()
    summary = run(Path(args.out), args.quick)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = "vision_colours" + ("_quick" if args.quick else "")
    (results / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {results / f'{name}.json'}")


if __name__ == "__main__":
    main()
