"""Scanning layers of several kinds (`ModelConfig.layer_kinds`: Qwen3.5's Gated DeltaNet layers between its
attention layers, Maverick's dense MLP layers between its mixtures, Gemma 4's full layers of their own width), each
kind's modules stacked over its own layers. `stacks` maps a name to (a pytree whose leaves are stacked over some
layers, those layers); layer(x, rows, kind, ...) runs one layer of `kind` on its rows (the names holding it).

`scan_layers_by_kind` (training): one scan step a layer, switching to its kind, its rows read by index from the
stacks (loop constants) before the switch; the backward holds one layer's work at a time (unrolled layers' would be
alive together: 4 layers, 2.7x one's on v6e); `scan_kv_sharing_layers` (Gemma 4) in three stretches.
`scan_layer_groups` (the cached decode, no backward): one step a period of the kinds' pattern, its layers unrolled.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.config.model import LayerKind


def scan_layers_by_kind(layer, x: jax.Array, stacks: dict[str, tuple[Any, tuple[int, ...]]], cfg: ModelConfig,
                        wrap=lambda fn: fn, span: tuple[int, int] | None = None, constants: Any = None,
                        wrap_branch=lambda fn: fn) -> tuple[jax.Array, Any]:
    """(x after the layers of `span` (default all), layer's outputs stacked over them; one structure for every
    kind). layer(x, rows, kind, constants) -> (x, out, keys and values; the last unused here). wrap(fn) -> fn: the
    step's remat round fn(x, per_layer, shared); wrap_branch(fn): each kind's inside the switch (jax's switch returns
    every branch's residuals, zeros for the kinds not taken; a checkpoint in each branch keeps its inputs alone: on
    a v6e-8, Qwen3.5-27B's LoRA step 22.3 -> 16.2 GiB a chip, Gemma-4-31B's 18.1 -> 15.9). Each step reads its
    layer's rows of every stack (row 0 of a stack its layer is not in, unused) before the switch: the branches'
    cotangents are a layer's rows, where rows read inside them made every branch return a whole stack's (a
    DeepSeek-V3 full fine-tune on v5p-512 held five float32 copies of its expert stacks)."""
    start, stop = span or (0, cfg.num_layers)
    kinds = cfg.layer_kinds
    present = sorted(set(kinds[start:stop]))  # a model of one kind needs no switch
    trees = {name: tree for name, (tree, _) in stacks.items()}
    index = {name: jnp.asarray([layers.index(i) if i in layers else 0 for i in range(start, stop)], jnp.int32)
             for name, (_, layers) in stacks.items()}

    def branch(kind: LayerKind):
        names = [name for name, (_, layers) in stacks.items() if any(kinds[i] == kind for i in layers)]
        return lambda x, rows, constants: layer(x, {name: rows[name] for name in names}, kind, constants)[:2]

    def one(x, per_layer, shared):
        (kind_i, rows_i), (trees, constants) = per_layer, shared
        rows = {name: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, rows_i[name], keepdims=False), tree)
                for name, tree in trees.items()}
        if len(present) == 1:
            return branch(present[0])(x, rows, constants)
        return jax.lax.switch(kind_i, [wrap_branch(branch(kind)) for kind in present], x, rows, constants)

    step = wrap(one)
    kind_L = jnp.asarray([present.index(kind) for kind in kinds[start:stop]], jnp.int32)
    return jax.lax.scan(lambda x, per_layer: step(x, per_layer, (trees, constants)), x, (kind_L, index))


def scan_kv_sharing_layers(layer, x: jax.Array, stacks: dict[str, tuple[Any, tuple[int, ...]]], cfg: ModelConfig,
                           wrap=lambda fn: fn, wrap_branch=lambda fn: fn) -> tuple[jax.Array, Any]:
    """`scan_layers_by_kind` over a model whose last layers attend over earlier layers' keys and values (Gemma 4's
    `shared_kv_layers`): the layers before the first such source scanned, the sources' stretch unrolled (typically
    two layers) keeping their keys and values, the sharing layers scanned with those as constants
    ({is full attention: (k, v)}), so no scan carries them."""
    first = cfg.num_layers - cfg.shared_kv_layers
    sources = {cfg.kv_source(i) for i in cfg.kv_sharing_layers}
    start = min(sources)
    outs = []
    if start:
        x, out = scan_layers_by_kind(layer, x, stacks, cfg, wrap, (0, start), wrap_branch=wrap_branch)
        outs.append(out)
    kept = {}
    for i in range(start, first):
        rows = {name: jax.tree.map(lambda a, r=layers.index(i): a[r], tree)
                for name, (tree, layers) in stacks.items() if i in layers}
        kind = cfg.layer_kinds[i]
        x, out, kv = wrap(lambda x, rows, constants, kind=kind: layer(x, rows, kind, constants))(x, rows, None)
        if i in sources:
            kept[kind.full] = kv
        outs.append(jax.tree.map(lambda a: a[None], out))
    x, out = scan_layers_by_kind(layer, x, stacks, cfg, wrap, (first, cfg.num_layers), kept, wrap_branch)
    outs.append(out)
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *outs)


def layer_period(cfg: ModelConfig, span: tuple[int, int] | None = None) -> int:
    """The smallest P dividing the span's length (default all L layers) such that its layers i and i + P are of one
    kind."""
    start, stop = span or (0, cfg.num_layers)
    n, kinds = stop - start, cfg.layer_kinds[start:stop]
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def scan_layer_groups(layer, x: jax.Array, stacks: dict[str, tuple[Any, tuple[int, ...]]], cfg: ModelConfig,
                      span: tuple[int, int] | None = None, group=lambda kind: kind.linear) -> tuple[jax.Array, dict]:
    """(x after the layers of `span` (default all), {group(kind): layer's outputs stacked over the span's layers of
    such kinds, in order}; default groups: the layers whose token mixer is (not) linear). Every name's layers must
    follow the period (as `ModelConfig.module_layers` do); a layer's output None is left out."""
    start, stop = span or (0, cfg.num_layers)
    P = layer_period(cfg, span)
    G = (stop - start) // P
    kinds = cfg.layer_kinds
    within = {name: [i - start for i in layers if start <= i < start + P] for name, (_, layers) in stacks.items()}
    first = {name: next((j for j, i in enumerate(layers) if i >= start), 0) for name, (_, layers) in stacks.items()}
    grouped = {name: jax.tree.map(lambda a, n=len(within[name]), f=first[name]: a[f:f + G * n].reshape(
        G, n, *a.shape[1:]), tree) for name, (tree, _) in stacks.items() if within[name]}

    def period(x: jax.Array, group_rows: dict) -> tuple[jax.Array, dict]:
        outs: dict[Any, list] = {}
        for j in range(P):
            rows = {name: jax.tree.map(lambda a, k=within[name].index(j): a[k], group_rows[name])
                    for name in group_rows if j in within[name]}
            x, out = layer(x, rows, kinds[start + j])
            if out is not None:
                outs.setdefault(group(kinds[start + j]), []).append(out)
        return x, {g: jax.tree.map(lambda *a: jnp.stack(a), *o) for g, o in outs.items()}

    x, outs = jax.lax.scan(period, x, grouped)
    return x, {g: jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), o)
               for g, o in outs.items()}
