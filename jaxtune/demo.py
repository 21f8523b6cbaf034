"""`jaxtune demo`: a real fine-tune, end to end, on 2 CPU cores in a few minutes, with no download.

1. Build a tiny Llama (4 layers, hidden 128, byte-level tokenizer) and give it a base: a short full fine-tune
   on plain text that ships with the package (words, numbers, capitals, the alphabet, but none of the tasks).
2. Fine-tune it with LoRA (all linear layers, rank 16) on the bundled instruction set: six small tasks whose
   rules generalise (capitalise, reverse words, add, first letter, count words, next letter).
3. Report the held-out completion loss and perplexity before and after, and greedy answers to held-out prompts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jaxtune.config import DataConfig, MethodConfig, ModelSection, SamplingConfig, TrainConfig
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.generation import generate_text
from jaxtune.methods.peft import load_model_with_adapter
from jaxtune.models.presets import write_random_model
from jaxtune.run_config import RunConfig
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


def run_demo(out: str | Path = "runs/demo", log=print) -> dict:
    """Run the demo into `out`; returns the held-out scores before and after the LoRA fine-tune."""
    out = Path(out)
    started = time.perf_counter()
    base_dir = write_random_model(out / "random-init", "llama", seed=0, **BASE_SHAPE)
    log(f"[1/3] built a tiny Llama ({base_dir}); training its base on plain text (full fine-tune) ...")
    base = fine_tune(RunConfig(
        model=ModelSection(path=str(base_dir)), method=MethodConfig("full"),
        data=DataConfig(train=str(ASSETS / "demo_corpus.jsonl"), eval_fraction=0.02, max_seq_len=128),
        train=TrainConfig(output_dir=str(out / "base"), max_steps=100, batch_size=16, learning_rate=3e-3,
                          warmup_steps=10, log_every=10)), log=_quiet)
    log(f"      base text loss {base.eval_loss:.3f} (perplexity {base.eval_perplexity:.2f})")

    log("[2/3] LoRA fine-tune (all linear layers, rank 16) on the bundled instructions ...")
    lora = fine_tune(RunConfig(
        model=ModelSection(path=str(base.result_path)),
        method=MethodConfig("lora", rank=16, alpha=16, target_modules=("all-linear",)),
        data=DataConfig(train=str(ASSETS / "demo_instructions.jsonl"), eval_fraction=0.1, max_seq_len=128),
        train=TrainConfig(output_dir=str(out / "lora"), max_steps=100, batch_size=16, learning_rate=3e-3,
                          log_every=10, eval_every=50)), log=_quiet)
    records = [json.loads(line) for line in (out / "lora" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    before, after = evals[0], evals[-1]
    log(f"      held-out completion loss {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}, "
        f"perplexity {before['eval_perplexity']:.2f} -> {after['eval_perplexity']:.2f} "
        f"(over {after['eval_tokens']} held-out completion tokens)")

    log("[3/3] greedy answers with the adapter:")
    cfg, params, method = load_model_with_adapter(base.result_path, lora.result_path)
    tokenizer = load_tokenizer(base.result_path)
    answers = generate_text(params, cfg, tokenizer, SAMPLE_PROMPTS, SamplingConfig(max_new_tokens=24),
                            stop_strings=("\n",), method=method)
    for prompt, answer in zip(SAMPLE_PROMPTS, answers):
        log(f"      {prompt.splitlines()[0][3:]!r} -> {answer.strip()!r}")
    log(f"done in {time.perf_counter() - started:.0f} s. Run directory: {out} (adapter: {lora.result_path}, "
        f"metrics: {out / 'lora' / 'metrics.jsonl'}, plot: {out / 'lora' / 'loss.png'})")
    return {"before": before, "after": after, "answers": answers}
