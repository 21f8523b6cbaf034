"""One layer's attention, forward and backward, as the train step runs it: jaxtune's blockwise kernel against
PyTorch's `scaled_dot_product_attention` on the same shapes, in one process, measured in turn.

    .venv/bin/python benchmarks/attention_layer.py                       # T = 128, 256, 512 (batch 4), 1024 (batch 1)
    .venv/bin/python benchmarks/attention_layer.py --seq 256 --dtype bfloat16
    git show REV:jaxtune/models/attention.py > /tmp/attention_rev.py
    .venv/bin/python benchmarks/attention_layer.py --compare /tmp/attention_rev.py   # and another version of the kernel

The benchmark model's heads (8 query heads sharing 4 key/value heads of 64), causal, every row one packed segment
(as `jaxtune train` packs). jaxtune: the kernel inside an 8-layer `lax.scan`, the gradient of q, k and v taken
through it, so the forward saves its residuals and the backward runs in its own loop, as in the step (a forward
and backward compiled into one program without the scan would share the forward's scores with the backward's
recomputation). PyTorch: `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` forward and backward,
2 intra-op threads (its CPU flash-attention kernel). Per configuration: milliseconds a layer, forward and backward
together, the median of `--rounds` rounds taken in turn, each the median of 3 calls. `--compare FILE` adds a
second attention module (another revision of `jaxtune/models/attention.py`), measured in the same rounds.
Results: benchmarks/results/attention_layer.json.
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
    """A function running `LAYERS` layers of the kernel's forward and backward; returns it and its inputs."""
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


def load_attention(path: str | None):
    if path is None:
        from jaxtune.models import attention
        return attention
    spec = importlib.util.spec_from_file_location(f"attention_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(fns: dict, rounds: int) -> dict:
    """Milliseconds a layer for each function: rounds in turn, each the median of 3 calls after one."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            calls = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - t0)
            times[name].append(statistics.median(calls) * 1e3 / LAYERS)
    return {name: {"ms_per_layer": round(statistics.median(t), 2), "min": round(min(t), 2), "max": round(max(t), 2)}
            for name, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (batch 4 up to 512, else 1)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compare", metavar="FILE", help="another attention.py, measured beside this one")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--output", default=str(HERE / "results" / "attention_layer.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from train_throughput import machine

    cases = [(T, 4 if T <= 512 else 1) for T in args.seq] if args.seq else DEFAULT_CASES
    kernels = {"jaxtune": load_attention(None)}
    if args.compare:
        kernels[f"jaxtune ({Path(args.compare).name})"] = load_attention(args.compare)
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
    out = Path(args.output)
    saved = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(saved + records, indent=1) + "\n")
    print(f"{'T':>5} {'B':>2} " + " ".join(f"{name:>34}" for name in records[0]["results"]))
    for r in records:
        cells = " ".join(f"{v['ms_per_layer']:>34.2f}" for v in r["results"].values())
        print(f"{r['seq']:>5} {r['batch']:>2} {cells}")


if __name__ == "__main__":
    main()
