"""A mixture's grouped matmuls alone on this CPU: `lax.ragged_dot` against `models/grouped_tiles.py` by tile rows.

    .venv/bin/python benchmarks/grouped_matmul.py --experts 8     # DeepSeek-V3's small shape in family_step.py

One layer's routed experts at family_step.py's shape: 1,024 tokens, top 2 (2,048 rows sorted by expert, routed
uniformly at random), hidden 256, experts of 256 (gate and up [E, 256, 512], down [E, 256, 256]), float32. Median
milliseconds of 20 calls of the forward, the forward with the input gradient (frozen experts, LoRA elsewhere) and
with the kernels' gradient too (experts that train); "routed rows once": one dense matmul over the rows with one
expert's kernels, the floor a grouped kernel can reach.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.models.grouped_tiles import tiled_grouped_matmul

TOKENS, TOP_K, HIDDEN, EXPERT = 1024, 2, 256, 256


def experts_mlp(product):
    """sum((silu(x W_g) * x W_u) W_d)^2 of the rows, each product by `product(x, w [E, in, out])`."""

    def loss(x, gate_up, down):
        gate, up = jnp.split(product(x, gate_up), 2, axis=-1)
        return jnp.sum(product(jax.nn.silu(gate) * up, down) ** 2)

    return loss


def median_ms(fn, *args, calls: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    E = parser.parse_args().experts
    rng = np.random.default_rng(0)
    sizes_E = jnp.asarray(np.bincount(rng.integers(0, E, TOKENS * TOP_K), minlength=E), jnp.int32)
    x = jnp.asarray(rng.standard_normal((TOKENS * TOP_K, HIDDEN)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((E, HIDDEN, 2 * EXPERT)) * 0.05, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, EXPERT, HIDDEN)) * 0.05, jnp.float32)
    products = {"ragged_dot": lambda x, w: jax.lax.ragged_dot(x, w, sizes_E),
                "routed rows once": lambda x, w: x @ w[0],
                **{f"tiles of {m}": functools.partial(lambda x, w, m: tiled_grouped_matmul(x, w, sizes_E, m), m=m)
                   for m in (64, 128, 256, 512)}}
    for name, product in products.items():
        loss = experts_mlp(product)
        times = [median_ms(jax.jit(f), x, gate_up, down) for f in
                 (loss, jax.grad(loss), jax.grad(loss, argnums=(0, 1, 2)))]
        print(f"{E} experts, {name}: forward {times[0]:.1f} ms, + input gradient {times[1]:.1f} ms, + kernels' "
              f"gradient {times[2]:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
