"""Scanning layers of two kinds, Qwen3.5's Gated DeltaNet layers between its attention layers, each kind's modules
stacked over its own layers. `stacks` maps a name to (a pytree whose leaves are stacked over some layers, those
layers); layer(x, rows, linear) runs one layer on its rows (the names holding it).

`scan_layers_by_kind` (training): one scan step a layer, switching to its kind, its rows read by index from the
stacks (loop constants, never copied); the backward holds one layer's work at a time (unrolled layers' would be
alive together: 4 layers, 2.7x one's on v6e). `scan_layer_groups` (the cached decode, no backward): one step a
period of the kinds' pattern (3 linear : 1 attention), its layers unrolled, each kind's outputs its own stack.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig


def scan_layers_by_kind(layer, x: jax.Array, stacks: dict[str, tuple[Any, tuple[int, ...]]], cfg: ModelConfig,
                        wrap=lambda fn: fn) -> tuple[jax.Array, Any]:
    """(x after every layer, layer's outputs stacked over the L layers; one structure for both kinds). wrap(fn) ->
    fn: the step's remat round fn(x, per_layer, stacks) (under remat "none" the switch keeps both kinds' residuals
    a layer, and the rows it read)."""
    L = cfg.num_layers
    linear = set(cfg.linear_attention_layers)
    trees = {name: tree for name, (tree, _) in stacks.items()}
    index = {name: jnp.asarray([layers.index(i) if i in layers else 0 for i in range(L)], jnp.int32)
             for name, (_, layers) in stacks.items()}

    def kind(is_linear: bool):
        names = [name for name, (_, layers) in stacks.items() if any((i in linear) == is_linear for i in layers)]

        def run(x, trees, rows_i):
            rows = {name: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, rows_i[name], keepdims=False),
                                       trees[name]) for name in names}
            return layer(x, rows, is_linear)
        return run

    present = sorted({i in linear for i in range(L)})  # a model of one kind needs no switch

    def one(x, per_layer, trees):
        is_linear, rows_i = per_layer
        if len(present) == 1:
            return kind(present[0])(x, trees, rows_i)
        return jax.lax.switch(is_linear, [kind(False), kind(True)], x, trees, rows_i)

    step = wrap(one)
    kinds = jnp.asarray([i in linear for i in range(L)], jnp.int32)
    return jax.lax.scan(lambda x, per_layer: step(x, per_layer, trees), x, (kinds, index))


def layer_period(cfg: ModelConfig) -> int:
    """The smallest P dividing L such that layer i and layer i + P are of one kind."""
    L, linear = cfg.num_layers, set(cfg.linear_attention_layers)
    return next(p for p in range(1, L + 1) if L % p == 0 and all((i in linear) == (i % p in linear) for i in range(L)))


def scan_layer_groups(layer, x: jax.Array, stacks: dict[str, tuple[Any, tuple[int, ...]]], cfg: ModelConfig
                      ) -> tuple[jax.Array, dict[bool, Any]]:
    """(x after every layer, {linear: layer's outputs stacked over the layers of that kind}). Every name's layers
    must follow the period (as `ModelConfig.module_layers` do)."""
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
            x, out = layer(x, rows, j in linear)
            outs[j in linear].append(out)
        return x, {kind: jax.tree.map(lambda *a: jnp.stack(a), *o) for kind, o in outs.items() if o}

    x, outs = jax.lax.scan(period, x, grouped)
    return x, {kind: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), o) for kind, o in outs.items()}
