"""RL rollouts: the rollout engine (`jaxtune.rollouts`) against `generate` and transformers' `generate`, same rows.

    .venv/bin/python benchmarks/rollout_engine.py                    # 16 prompts x group 4, limits 16..256, ~10 min
    .venv/bin/python benchmarks/rollout_engine.py --prompts 4 --longest-limit 64 --repeat 1   # a quick look

A Qwen2-shaped model with random weights (tests/hf_models.py's twin: transformers builds it and saves it, jaxtune
reads the same tensors), float32; `--prompts` random prompts of 32..`--longest-prompt` tokens, each sampled
`--group` times greedily (a GRPO step's rows: the prompt repeated), each sample with its own limit drawn from
16..`--longest-limit` (random weights rarely meet EOS, so the limits set the work). The same rows three ways:
- the engine: `sample_groups`, for each of `--slots` slot counts, over a pool of pages of `--page-size` tokens (the
  default pool: the prompts' pages and every slot's longest limit), each prompt prefilled once;
- `generate`: the prompts repeated, one batch, each row's limit (`max_new_tokens_of_row`): a dense left-padded cache
  of prompt + the longest limit per row, decoding until the last row ends;
- transformers' `generate`: the repeated prompts left-padded in one batch to the longest limit (it has no per-row
  limit), each row's tokens then cut to its limit (sdpa, torch threads = cores).
Tokens/s counts each sample's tokens up to its limit, the same count for all three. Times: the best of `--repeat`
timed calls each (interleaved) after a warm-up call (jaxtune's compiles happen there, reported apart). Results go to
benchmarks/results/rollout_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
from generation_throughput import cpu_name

from jaxtune.config import SamplingConfig
from jaxtune.generation import generate
from jaxtune.rollouts import PagePool, sample_groups
from jaxtune.spine.model import load_model

HERE = Path(__file__).resolve().parent
# A small Qwen2 (~40M parameters): 8 layers of hidden 512, grouped-query attention 8/4 heads of 64, vocab 32,000.
SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, eos_token_id=2, bos_token_id=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts (default 16)")
    parser.add_argument("--group", type=int, default=4, help="samples of each prompt (default 4)")
    parser.add_argument("--longest-prompt", type=int, default=200, help="the longest prompt's tokens (default 200)")
    parser.add_argument("--longest-limit", type=int, default=256, help="limits run 16..this (default 256)")
    parser.add_argument("--slots", default="16,32", help="the engine's slots, a run each (default 16,32)")
    parser.add_argument("--page-size", type=int, default=16, help="the engine's page size (default 16)")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls each after the warm-up (default 2)")
    parser.add_argument("--skip-transformers", action="store_true", help="the two jaxtune ways only")
    parser.add_argument("--out", default=str(HERE / "results" / "rollout_engine.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "tests"))
    import torch
    import transformers
    from hf_models import make_hf_model

    torch.set_num_threads(os.cpu_count() or 1)
    directory = Path(tempfile.mkdtemp())
    model = make_hf_model("qwen2", directory, seed=0, **SHAPE)
    cfg, params = load_model(directory, np.float32)
    rng = np.random.RandomState(0)
    lengths = np.linspace(32, args.longest_prompt, args.prompts).astype(int)
    prompts = [rng.randint(3, cfg.vocab_size, n).tolist() for n in lengths]
    limits = rng.randint(16, args.longest_limit + 1, args.prompts * args.group).tolist()
    repeated = [p for p in prompts for _ in range(args.group)]
    eos = SHAPE["eos_token_id"]
    sampling = SamplingConfig(max_new_tokens=max(limits))
    slot_counts = [int(n) for n in args.slots.split(",")]
    T = max(map(len, repeated))
    ids, mask = np.zeros((len(repeated), T), np.int64), np.zeros((len(repeated), T), np.int64)
    for row, p in enumerate(repeated):
        ids[row, T - len(p):], mask[row, T - len(p):] = p, 1
    engine_stats: dict[str, dict] = {}

    def engine_run(slots: int):
        out = sample_groups(params, cfg, prompts, args.group, sampling, pool=PagePool(slots, args.page_size),
                            eos_ids=[eos], max_new_tokens_of_sample=limits)
        engine_stats[f"engine, {slots} slots"] = dict(num_pages=out.num_pages, peak_pages=out.peak_pages,
                                                      steps=out.steps, free_pages_after=out.free_pages)
        return out.tokens

    def generate_run():
        return generate(params, cfg, repeated, sampling, eos_ids=[eos], max_new_tokens_of_row=limits)

    def torch_run(ids=ids, mask=mask):
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                                 max_new_tokens=max(limits), pad_token_id=eos, eos_token_id=eos, top_p=None,
                                 top_k=None, temperature=None)
        rows = out[:, ids.shape[1]:].tolist()
        return [(row[: row.index(eos)] if eos in row else row)[:n] for row, n in zip(rows, limits)]

    runs = {f"engine, {n} slots": partial(engine_run, n) for n in slot_counts}
    runs["generate"] = generate_run
    if not args.skip_transformers:
        runs["transformers"] = torch_run
    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(seconds) if event.endswith("backend_compile_duration") else None)
    warm_up, compile_s = {}, {}
    for name, run in runs.items():
        before, start = len(compiles), time.perf_counter()
        run(ids[:2], mask[:2]) if name == "transformers" else run()
        warm_up[name], compile_s[name] = time.perf_counter() - start, sum(compiles[before:])
    best, outputs = dict.fromkeys(runs, float("inf")), {}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            outputs[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
        loads.append(os.getloadavg()[0])
    counts = {name: sum(map(len, rows)) for name, rows in outputs.items()}
    same = {name: sum(a == b for a, b in zip(outputs["generate"], rows)) for name, rows in outputs.items()}
    results = [{"way": name, "seconds": round(best[name], 3), "new_tokens": counts[name],
                "tokens_per_s": round(counts[name] / best[name], 1), "warm_up_s": round(warm_up[name], 2),
                "compile_s": round(compile_s[name], 2), "rows_equal_to_generate": same[name]} for name in runs]
    record = {"model": "Qwen2 shape, random weights, float32", "shape": SHAPE, "prompts": args.prompts,
              "group": args.group, "samples": len(limits), "prompt_tokens": [int(lengths[0]), int(lengths[-1])],
              "limits": [min(limits), max(limits), sum(limits)], "page_size": args.page_size,
              "engine": engine_stats, "cpu": cpu_name(), "cores": os.cpu_count(), "load_1min": loads,
              "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
              "results": results}
    print(f"{record['model']}; {args.prompts} prompts of {lengths[0]}-{lengths[-1]} tokens x group {args.group}, "
          f"limits {min(limits)}-{max(limits)} ({sum(limits)} tokens), greedy; {record['cpu']}, {os.cpu_count()} "
          f"cores, load {', '.join(f'{x:.1f}' for x in loads)}\n")
    print("| way | s (best) | new tokens | tokens/s | warm-up s | compile s | rows equal to generate's |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['way']} | {r['seconds']:.2f} | {r['new_tokens']} | {r['tokens_per_s']:.1f} | "
              f"{r['warm_up_s']:.1f} | {r['compile_s']:.1f} | {r['rows_equal_to_generate']}/{len(limits)} |")
    for name, stats in engine_stats.items():
        print(f"{name}: {stats}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
