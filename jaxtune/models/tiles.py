"""Token tiles: arrays [B, T, ...] cut into n tiles [n, B, N x c, ...] of c tokens a device, and joined back, for
loops over the tokens (the chunked head, the tiled MLP). N is the mesh's `context` axis (1 without one): each
device's shard of the tokens is cut alike, so a tile takes c tokens from every device and no loop step gathers a
row. `over_tiles` runs a function over the tiles, each recomputed in the backward instead of kept.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtune.parallel.rules import context_ways


def tile_count(T: int, c: int) -> tuple[int, int]:
    """(N, n): the devices sharing the tokens and the tiles of c tokens a device, for rows of T tokens."""
    ways = context_ways()
    ways = ways if T % ways == 0 else 1
    return ways, -(-(T // ways) // c)


def cut_tiles(a: jax.Array, c: int) -> jax.Array:
    """[B, T, ...] -> [n, B, N x c, ...]: each device's T / N tokens in n tiles of c (the last padded)."""
    B, T = a.shape[:2]
    ways, n = tile_count(T, c)
    a = a.reshape((B, ways, T // ways) + a.shape[2:])
    a = jnp.pad(a, [(0, 0), (0, 0), (0, n * c - T // ways)] + [(0, 0)] * (a.ndim - 3))
    a = jnp.moveaxis(a.reshape((B, ways, n, c) + a.shape[3:]), 2, 0)
    return a.reshape((n, B, ways * c) + a.shape[4:])


def join_tiles(a: jax.Array, T: int) -> jax.Array:
    """The inverse of `cut_tiles`: [n, B, N x c, ...] -> [B, T, ...]."""
    n, B = a.shape[:2]
    ways = tile_count(T, 1)[0]
    c = a.shape[2] // ways
    a = jnp.moveaxis(a.reshape((n, B, ways, c) + a.shape[3:]), 0, 2)
    a = a.reshape((B, ways, n * c) + a.shape[4:])[:, :, :T // ways]
    return a.reshape((B, T) + a.shape[3:])


def over_tiles(fn: Callable, *arrays_BxT: jax.Array, tile: int):
    """fn applied tile by tile ([B, N x c, ...] arrays to a pytree of [B, N x c, ...]), joined back to [B, T, ...];
    nothing of a tile is kept for the backward, which runs fn again (`jax.checkpoint`)."""
    T = arrays_BxT[0].shape[1]
    body = jax.checkpoint(lambda carry, tiles: (carry, fn(*tiles)), prevent_cse=False)
    _, out = jax.lax.scan(body, None, tuple(cut_tiles(a, tile) for a in arrays_BxT))
    return jax.tree.map(lambda o: join_tiles(o, T), out)
