"""The train-throughput benchmark's jaxtune step of one configuration compiled twice in one process, as the code is
and with a patch applied, then stepped in turn, one step each, the order flipped every pair. On a noisy machine the
ratio of two steps taken back to back is steadier than two runs' medians.

    .venv/bin/python benchmarks/paired_step.py lora_qv benchmarks/patches/before_issue34.py --pairs 20
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 .venv/bin/python benchmarks/paired_step.py lora_all PATCH   # as on Zen 3

A patch is a Python file that replaces some of jaxtune's functions when run and defines `undo()`; the patched step
is traced and compiled between the two. Prints and appends to benchmarks/results/paired_step.json: the machine
(as train_throughput.py records it), both compile
times, both median step times, the median of the per-pair ratios (patched time / current time: above 1, the
current code is faster) with a bootstrap 90% interval, and in how many pairs the current code was faster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import statistics
import time
from pathlib import Path

from train_throughput import machine

HERE = Path(__file__).resolve().parent


def compiled_step(config: str, patch: str | None):
    """A function taking one step of `config` (returning its seconds), compiled with `patch` applied, and the
    compile's seconds."""
    import _jax_worker as worker
    import jax

    from jaxtune.config import MeshConfig
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.spine.run import abstract_run

    undo = _undo_of(patch) if patch else None
    try:
        jax.clear_caches()
        cfg, plan, tc, trainable, frozen, batch = worker.model_and_batch(config)
        run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]), tc, 10**6)
        state = {"value": run.init_state(trainable, seed=0)}
        start = time.perf_counter()
        compiled = run.step.lower(state["value"], frozen, None, batch).compile()
        compile_s = time.perf_counter() - start
    finally:
        if undo:
            undo()

    def step() -> float:
        start = time.perf_counter()
        state["value"], _ = compiled(state["value"], frozen, None, batch)
        jax.block_until_ready(state["value"])
        return time.perf_counter() - start

    return step, compile_s


def _undo_of(patch: str):
    """Runs the patch file and returns its `undo`; a file without one is a one-line error naming it."""
    undo = runpy.run_path(patch).get("undo")
    if not callable(undo):
        raise SystemExit(f"{patch}: defines no undo() to restore what it patched")
    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", choices=("full", "lora_qv", "lora_all", "qlora", "lora_qv_bf16"))
    parser.add_argument("patch", help="a Python file that patches jaxtune and defines undo()")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results" / "paired_step.json"))
    args = parser.parse_args()
    if not Path(args.patch).is_file():
        parser.error(f"{args.patch}: no such patch file")

    from jaxtune.host_memory import release_after_compiles, return_large_blocks

    release_after_compiles()
    return_large_blocks()
    current, current_compile = compiled_step(args.config, None)
    patched, patched_compile = compiled_step(args.config, args.patch)
    for _ in range(args.warmup):
        current(), patched()
    times = {"current": [], "patched": []}
    for i in range(args.pairs):
        order = (("patched", patched), ("current", current)) if i % 2 else (("current", current), ("patched", patched))
        for name, step in order:
            times[name].append(step())
    ratios = [p / c for p, c in zip(times["patched"], times["current"])]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    result = {
        "config": args.config, "patch": os.path.basename(args.patch), "pairs": args.pairs,
        "machine": machine(),
        "compile_s": {"current": round(current_compile, 2), "patched": round(patched_compile, 2)},
        "step_ms": {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()},
        "speedup": round(statistics.median(ratios), 3), "speedup_90": [round(boot[100], 3), round(boot[1899], 3)],
        "current_faster_in": sum(r > 1 for r in ratios),
    }
    print(json.dumps(result))
    path = Path(args.output)
    runs = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(runs + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
