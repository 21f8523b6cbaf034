"""A dataset larger than memory: does `jaxtune train` stream it, or hold its tokens?

    python benchmarks/data_streaming.py              # ~5 min on 2 cores; writes benchmarks/results/data_streaming.json
    python benchmarks/data_streaming.py --mb 50 400  # JSONL sizes in MB

For each size, a JSONL file of prompt/completion rows (random words; the tiny demo model's byte-level tokenizer
makes a token of every byte) is trained on for three steps by `jaxtune train` in a fresh process: tokenised once
into a store beside the run (`data/store.py`), split, packed, batches read from the memory-mapped store. Reported:
the process's peak RSS (ru_maxrss) and the wall time, and, for contrast, the peak RSS of reading the same file
with the in-memory loader (`load_sft_examples`, a Python list of examples: what the trainer did before the store).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxtune.presets import write_random_model

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
TRAIN = "from jaxtune.cli import main; sys.exit(main(['train', CONFIG]))"
IN_MEMORY = ("from jaxtune.data.formats import load_sft_examples; from jaxtune.data.tokenizer import load_tokenizer; "
             "examples, _ = load_sft_examples(DATA, load_tokenizer(MODEL), 512)")


def write_rows(path: Path, megabytes: int) -> int:
    """A JSONL file of about `megabytes` MB of prompt/completion rows; returns its row count."""
    rng = np.random.default_rng(0)
    vocabulary = np.array(WORDS)
    rows, size = 0, 0
    with open(path, "w") as f:
        while size < megabytes * 1e6:
            block = []
            for _ in range(1000):
                prompt = " ".join(vocabulary[rng.integers(0, len(WORDS), rng.integers(5, 30))])
                completion = " ".join(vocabulary[rng.integers(0, len(WORDS), rng.integers(20, 70))])
                block.append(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            text = "".join(block)
            f.write(text)
            rows, size = rows + len(block), size + len(text)
    return rows


def measured(program: str, **names) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of `program` in a fresh process, `names` bound as its globals; the peak is
    read by a parent of its own, since RUSAGE_CHILDREN holds the largest child so far."""
    child = "import sys; " + "; ".join(f"{k} = {str(v)!r}" for k, v in names.items()) + "; " + program
    parent = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(p.returncode)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", parent, sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=3600, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    seconds = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])
    return int(out.stdout.strip().splitlines()[-1]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[50, 400], help="JSONL sizes in MB")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_random_model(tmp / "model", "llama")
        for mb in sorted(args.mb):
            data = tmp / f"rows{mb}.jsonl"
            count = write_rows(data, mb)
            config = tmp / f"run{mb}.toml"
            config.write_text(f'[model]\npath = "{model}"\n[method]\nkind = "lora"\n[data]\ntrain = "{data}"\n'
                              f'max_seq_len = 512\neval_fraction = 0.001\n[train]\noutput_dir = "{tmp / f"run{mb}"}"\n'
                              'batch_size = 8\nmax_steps = 3\neval_every = 1000\n')
            train_peak, train_s = measured(TRAIN, CONFIG=config)
            store = tmp / f"run{mb}" / "cache"
            store_bytes = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
            memory_peak, memory_s = measured(IN_MEMORY, DATA=data, MODEL=model)
            row = {"jsonl_mb": data.stat().st_size / 1e6, "rows": count, "store_mb": store_bytes / 1e6,
                   "train_peak_rss_mib": train_peak / MiB, "train_s": train_s,
                   "in_memory_peak_rss_mib": memory_peak / MiB, "in_memory_s": memory_s}
            rows.append(row)
            print(f"{row['jsonl_mb']:6.0f} MB JSONL, {count:,} rows, store {row['store_mb']:.0f} MB: jaxtune train "
                  f"(3 steps) peak RSS {row['train_peak_rss_mib']:.0f} MiB in {train_s:.0f} s; the in-memory loader "
                  f"alone {row['in_memory_peak_rss_mib']:.0f} MiB in {memory_s:.0f} s", flush=True)
    out = ROOT / "benchmarks" / "results" / "data_streaming.json"
    out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
