"""One layer's attention, forward and backward, as the train step runs it: jaxtune's blockwise kernel against
PyTorch's `scaled_dot_product_attention` on the same shapes, in one process, measured in turn.

    .venv/bin/python benchmarks/attention_layer.py                       # T = 128, 256, 512 (batch 4), 1024 (batch 1)
    .venv/bin/python benchmarks/attention_layer.py --seq 256 --dtype bfloat16
    git show REV:jaxtune/models/attention.py > /tmp/attention_rev.py
    .venv/bin/python benchmarks/attention_layer.py --compare /tmp/attention_rev.py   # and another version of the kernel
    .venv/bin/python benchmarks/attention_layer.py --step lora_qv --compare /tmp/attention_rev.py   # whole steps

The benchmark model's heads (8 query heads sharing 4 key/value heads of 64), causal, every row one packed segment
(as `jaxtune train` packs). jaxtune: the kernel inside an 8-layer `lax.scan`, the gradient of q, k and v taken
through it, so the forward saves its residuals and the backward runs in its own loop, as in the step (a forward
and backward compiled into one program without the scan would share the forward's scores with the backward's
recomputation). PyTorch: `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` forward and backward,
2 intra-op threads (its CPU flash-attention kernel). Per configuration: milliseconds a layer, forward and backward
together, the median of `--rounds` rounds taken in turn, each the median of 3 calls. `--compare FILE` adds a
second attention module (another revision of `jaxtune/models/attention.py`), measured in the same rounds;
`--step CONFIG --compare FILE` times the train-throughput benchmark's whole jaxtune step of CONFIG compiled with each
module (milliseconds a step, steps in turn in one process). Results: benchmarks/results/attention_layer.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS, KV_HEADS, GROUP, HEAD_DIM = 8, 4, 2, 64
DEFAULT_CASES = ((128, 4), (256, 4), (512, 4), (1024, 1))


def jax_layer(attention, T: int, B: int, dtype: str):
    """A function running `LAYERS` layers of the kernel's forward and backward (compiled, on fixed inputs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    shape_q, shape_kv = (LAYERS, B, KV_HEADS, GROUP, T, HEAD_DIM), (LAYERS, B, KV_HEADS, T, HEAD_DIM)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in (shape_q, shape_kv, shape_kv))
    g = jnp.asarray(rng.standard_normal(shape_q), jnp.float32)
    segments = jnp.ones((B, T), jnp.int32)

    def loss(q, k, v):
        mask = attention.training_mask(B, T, 0, None, segments)
        live = attention.live_blocks(mask, T, T)

        def layer(total, xs):
            q, k, v, g = xs
            out = attention.blockwise_attention(q, k, v, mask, 0, live)
            return total + jnp.sum(out.astype(jnp.float32) * g), None

        return jax.lax.scan(layer, jnp.float32(0), (q, k, v, g))[0]

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return lambda: jax.block_until_ready(step(q, k, v))


def torch_layer(T: int, B: int, dtype: str):
    """One layer of torch's sdpa forward and backward, `LAYERS` times (the same work as the jaxtune function)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    tdtype = getattr(torch, dtype)
    q = torch.randn(B, KV_HEADS * GROUP, T, HEAD_DIM, generator=gen).to(tdtype).requires_grad_()
    k, v = (torch.randn(B, KV_HEADS, T, HEAD_DIM, generator=gen).to(tdtype).requires_grad_() for _ in range(2))
    g = torch.randn(B, KV_HEADS * GROUP, T, HEAD_DIM, generator=gen).to(tdtype)

    def run():
        for _ in range(LAYERS):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(g)
            q.grad = k.grad = v.grad = None

    return run


def train_steps(kernels: dict, config: str):
    """The train-throughput benchmark's jaxtune step (`_jax_worker`'s model, batch and spine step) compiled once
    with each attention module in `kernels` (the model's three attention names swapped in while it traces); returns
    {name: a function taking one step}."""
    import jax
    import jax.numpy as jnp
    from _jax_worker import model_and_batch

    from jaxtune.config import MeshConfig
    from jaxtune.models import llama
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.spine.run import abstract_run

    cfg, plan, tc, trainable, frozen, batch = model_and_batch(config)
    names = ("blockwise_attention", "live_blocks", "training_mask")
    own = {name: getattr(llama, name) for name in names}
    steps = {}
    for label, module in kernels.items():
        for name in names:
            setattr(llama, name, getattr(module, name))
        jax.clear_caches()  # each module traced anew, not the cached trace of the other
        run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]), tc, 10_000)
        holder = {"state": run.init_state(jax.tree.map(jnp.copy, trainable), seed=0)}
        compiled = run.step.lower(holder["state"], frozen, None, batch).compile()

        def step(compiled=compiled, holder=holder):
            holder["state"], _ = compiled(holder["state"], frozen, None, batch)
            jax.block_until_ready(holder["state"])

        steps[label] = step
    for name in names:
        setattr(llama, name, own[name])
    return steps


def load_attention(path: str | None):
    if path is None:
        from jaxtune.models import attention
        return attention
    spec = importlib.util.spec_from_file_location(f"attention_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def append_records(path: str, records: list) -> None:
    """Add `records` to the JSON list saved at `path` (created if absent)."""
    out = Path(path)
    out.write_text(json.dumps((json.loads(out.read_text()) if out.exists() else []) + records, indent=1) + "\n")


def measure(fns: dict, rounds: int, per_call: int = LAYERS) -> dict:
    """Milliseconds a call / per_call (a layer) for each function: rounds in turn, each the median of 3 calls after
    one."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            calls = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - t0)
            times[name].append(statistics.median(calls) * 1e3 / per_call)
    return {name: {"ms": round(statistics.median(t), 2), "min": round(min(t), 2), "max": round(max(t), 2)}
            for name, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (batch 4 up to 512, else 1)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compare", metavar="FILE", help="another attention.py, measured beside this one")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--step", metavar="CONFIG", choices=("full", "lora_qv", "lora_all", "qlora", "lora_qv_bf16"),
                        help="time the train-throughput benchmark's whole jaxtune step of CONFIG (full, lora_qv, "
                        "lora_all, qlora, lora_qv_bf16) with each kernel instead, in turn")
    parser.add_argument("--output", default=str(HERE / "results" / "attention_layer.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from train_throughput import machine

    kernels = {"jaxtune": load_attention(None)}
    if args.compare:
        kernels[f"jaxtune ({Path(args.compare).name})"] = load_attention(args.compare)
    if args.step:  # whole train steps, milliseconds a step
        result = measure(train_steps(kernels, args.step), args.rounds, per_call=1)
        record = {"step": args.step, "results": result, "machine": machine(), "python": platform.python_version()}
        print(json.dumps(record["results"] | {"step": args.step}), flush=True)
        append_records(args.output, [record])
        return
    cases = [(T, 4 if T <= 512 else 1) for T in args.seq] if args.seq else DEFAULT_CASES
    records = []
    for T, B in cases:
        fns = {name: jax_layer(module, T, B, args.dtype) for name, module in kernels.items()}
        if not args.no_torch:
            fns["PyTorch sdpa"] = torch_layer(T, B, args.dtype)
        result = measure(fns, args.rounds)
        record = {"seq": T, "batch": B, "dtype": args.dtype, "results": result, "machine": machine(),
                  "python": platform.python_version()}
        records.append(record)
        print(json.dumps(record["results"] | {"seq": T, "batch": B, "dtype": args.dtype}), flush=True)
    append_records(args.output, records)
    print(f"{'T':>5} {'B':>2} " + " ".join(f"{name:>34}" for name in records[0]["results"]))
    for r in records:
        cells = " ".join(f"{v['ms']:>34.2f}" for v in r["results"].values())
        print(f"{r['seq']:>5} {r['batch']:>2} {cells}")


if __name__ == "__main__":
    main()
