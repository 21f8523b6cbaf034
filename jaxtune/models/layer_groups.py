"""One scan over layers that differ: Qwen3.5's Gated DeltaNet layers between its attention layers, each kind's
modules stacked over its own layers. The layer kinds repeat with a period P (3 linear : 1 attention), so the scan
runs over the L / P periods and its body holds the P layers of one, unrolled: compile time grows with P, not L.

`scan_layer_groups(block, x, stacks, cfg)`: `stacks` maps a name to (a pytree whose leaves are stacked over some
layers, those layers); the body hands block(x, rows, linear) each layer's rows (the names holding it) and whether it
is a linear-attention layer; the outputs come back per kind, stacked over that kind's layers in order.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig


def layer_period(cfg: ModelConfig) -> int:
    """The smallest P dividing L such that layer i and layer i + P are of one kind."""
    L, linear = cfg.num_layers, set(cfg.linear_attention_layers)
    return next(p for p in range(1, L + 1) if L % p == 0 and all((i in linear) == (i % p in linear) for i in range(L)))


def scan_layer_groups(block, x: jax.Array, stacks: dict[str, tuple[Any, tuple[int, ...]]], cfg: ModelConfig
                      ) -> tuple[jax.Array, dict[bool, Any]]:
    """(x after every layer, {linear: block's outputs stacked over the layers of that kind}); see the module
    docstring. Every name's layers must follow the period (as `ModelConfig.module_layers` do)."""
    P = layer_period(cfg)
    G = cfg.num_layers // P
    linear = set(cfg.linear_attention_layers)
    within = {name: [i for i in layers if i < P] for name, (_, layers) in stacks.items()}  # the first period's
    grouped = {name: jax.tree.map(lambda a, n=len(within[name]): a.reshape(G, n, *a.shape[1:]), tree)
               for name, (tree, _) in stacks.items()}

    def period(x: jax.Array, group: dict) -> tuple[jax.Array, dict]:
        outs: dict[bool, list] = {True: [], False: []}
        for j in range(P):
            rows = {name: jax.tree.map(lambda a, k=within[name].index(j): a[k], group[name])
                    for name in group if j in within[name]}
            x, out = block(x, rows, j in linear)
            outs[j in linear].append(out)
        return x, {kind: jax.tree.map(lambda *a: jnp.stack(a), *o) for kind, o in outs.items() if o}

    x, outs = jax.lax.scan(period, x, grouped)
    return x, {kind: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), o) for kind, o in outs.items()}
