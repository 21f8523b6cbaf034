"""GGUF quantisation time: seconds per million weights of jaxtune's k-quant quantisers (numpy, every core) against
ggml's own (`ggml_quantize_chunk` in llama-cpp-python's library, one thread, as llama-quantize runs each chunk) on
a Llama-3-8B-shaped matrix, extrapolated to the 8B model's 8.03e9 weights; and `jaxtune export --gguf-type KIND` of
SmolLM2-135M-Instruct end to end (load, merge, quantise, write) against llama.cpp's `llama_model_quantize` of its
f32 export on every core.

    python benchmarks/gguf_quantize.py [--rows 1024] [--kinds q4_k_m q6_k] [--out results/gguf_quantize.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
WEIGHTS_8B = 8.03e9


def per_million(run, weights: int, repeat: int = 3) -> float:
    """The fastest of `repeat` runs, in seconds per million weights."""
    best = min(_timed(run) for _ in range(repeat))
    return best / (weights / 1e6)


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="rows of 4096 weights quantised (default 1024)")
    parser.add_argument("--kinds", nargs="*", default=["q4_k_m", "q5_k_m", "q6_k"], help="export kinds timed")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    import llama_cpp
    from ggml_quants import ggml_quantize
    from import_time import cpu_model
    from test_gguf import smollm2_path

    from jaxtune.cli import main as cli
    from jaxtune.io.gguf_kquants import quantize_rows
    from jaxtune.methods.gguf_mixture import MIXTURES

    rows = (np.random.default_rng(0).standard_normal((args.rows, 4096)) * 0.02).astype(np.float32)
    blocks = {}
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        ours = per_million(lambda: quantize_rows(rows, kind), rows.size)
        theirs = per_million(lambda: ggml_quantize(rows, kind), rows.size)
        blocks[kind] = {"jaxtune_s_per_M": round(ours, 4), "ggml_one_thread_s_per_M": round(theirs, 4),
                        "jaxtune_8b_minutes": round(ours * WEIGHTS_8B / 1e6 / 60, 1),
                        "ggml_one_thread_8b_minutes": round(theirs * WEIGHTS_8B / 1e6 / 60, 1)}
        print(kind, blocks[kind], flush=True)
    exports = {}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        seconds_f32 = _timed(lambda: cli(["export", "--model", str(smollm2_path()), "--gguf", str(f32), "--type",
                                          "f32"]))
        for kind in args.kinds:
            out, theirs_out = Path(tmp) / f"{kind}.gguf", Path(tmp) / f"llama-{kind}.gguf"
            ours = _timed(lambda: cli(["export", "--model", str(smollm2_path()), "--gguf", str(out), "--gguf-type",
                                       kind]))
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = MIXTURES[kind][0].value
            theirs = _timed(lambda: llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs_out).encode(),
                                                                   ctypes.byref(params)))
            exports[kind] = {"jaxtune_export_s": round(ours, 1), "llama_quantize_s": round(theirs, 1)}
            print(kind, exports[kind], flush=True)
    record = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
              "matrix": [args.rows, 4096], "blocks": blocks, "smollm2_f32_export_s": round(seconds_f32, 1),
              "smollm2_exports": exports}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
