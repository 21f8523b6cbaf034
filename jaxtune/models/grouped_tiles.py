"""A grouped matmul for platforms with no grouped kernel (XLA:CPU): rows sorted by group, cut into tiles of m rows,
each (tile, group) pair that meets computed once, as Pallas' megablox `gmm` walks them (Gale et al., MegaBlocks), in
a `lax.scan`. Its cost is the routed rows plus at most a tile a group, not `lax.ragged_dot`'s dense matmul per
group over every row (XLA:CPU's lowering): E/K times the routed work of a top-K mixture of E experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

TILE_ROWS = 128  # m: of 64, 128, 256 and 512, the fastest on XLA:CPU at 4 and 8 experts of 256 (benchmarks/README.md)
SCOPE = "grouped_tiles"  # its ops' names in a compiled program (`planner.confirm.grouped_matmul_kernel`)


def _work(sizes_E: jax.Array, tiles: int, m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The (tile, group) pairs that meet, at most tiles + E - 1, in row order: (tile [W], group [W], each pair's
    rows' first and end [W], an empty range for the pairs beyond the last)."""
    E = sizes_E.shape[0]
    ends_E = jnp.cumsum(sizes_E)
    starts_E = ends_E - sizes_E
    first_E = starts_E // m
    count_E = jnp.where(sizes_E > 0, (ends_E - 1) // m - first_E + 1, 0)
    reach_E = jnp.cumsum(count_E)
    w_W = jnp.arange(tiles + E - 1)
    group_W = jnp.minimum(jnp.searchsorted(reach_E, w_W, side="right"), E - 1)
    tile_W = jnp.clip(first_E[group_W] + w_W - (reach_E - count_E)[group_W], 0, tiles - 1)
    real_W = w_W < reach_E[-1]
    return tile_W, group_W, jnp.where(real_W, starts_E[group_W], 0), jnp.where(real_W, ends_E[group_W], 0)


def _tiled(x_MxI: jax.Array, m: int) -> jax.Array:
    """x padded to whole tiles: [M / m, m, I]."""
    return jnp.pad(x_MxI, ((0, -x_MxI.shape[0] % m), (0, 0))).reshape(-1, m, x_MxI.shape[1])


def _mine(t: jax.Array, start: jax.Array, end: jax.Array, m: int) -> jax.Array:
    """Which of tile t's m rows lie in start..end: [m] bool."""
    rows_m = t * m + jnp.arange(m)
    return (rows_m >= start) & (rows_m < end)


def _products(x_MxI: jax.Array, w_ExIxO: jax.Array, sizes_E: jax.Array, m: int) -> jax.Array:
    """Each row times its group's kernel: [M, O], one tile against one group's kernel a scan step."""
    M, wide = x_MxI.shape[0], jnp.promote_types(x_MxI.dtype, jnp.float32)
    x_TxmxI = _tiled(x_MxI, m)

    def pair(y_TxmxO, work):
        t, g, start, end = work
        y_mxO = jnp.dot(x_TxmxI[t], w_ExIxO[g], preferred_element_type=wide).astype(y_TxmxO.dtype)
        return y_TxmxO.at[t].add(jnp.where(_mine(t, start, end, m)[:, None], y_mxO, 0)), None

    y_TxmxO = jnp.zeros((x_TxmxI.shape[0], m, w_ExIxO.shape[-1]), x_MxI.dtype)
    y_TxmxO = jax.lax.scan(pair, y_TxmxO, _work(sizes_E, x_TxmxI.shape[0], m))[0]
    return y_TxmxO.reshape(-1, y_TxmxO.shape[-1])[:M]


def _kernel_gradient(x_MxI: jax.Array, dy_MxO: jax.Array, sizes_E: jax.Array, E: int, m: int) -> jax.Array:
    """sum over each group's rows of x^T dy: [E, I, O], at least float32."""
    x_TxmxI, dy_TxmxO = _tiled(x_MxI, m), _tiled(dy_MxO, m)

    def pair(dw_ExIxO, work):
        t, g, start, end = work
        dy_mxO = jnp.where(_mine(t, start, end, m)[:, None], dy_TxmxO[t], 0)
        return dw_ExIxO.at[g].add(jnp.dot(x_TxmxI[t].T, dy_mxO, preferred_element_type=dw_ExIxO.dtype)), None

    dw_ExIxO = jnp.zeros((E, x_MxI.shape[1], dy_MxO.shape[1]), jnp.promote_types(x_MxI.dtype, jnp.float32))
    return jax.lax.scan(pair, dw_ExIxO, _work(sizes_E, x_TxmxI.shape[0], m))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled_grouped_matmul(x_MxI: jax.Array, w_ExIxO: jax.Array, sizes_E: jax.Array, m: int = TILE_ROWS) -> jax.Array:
    """Rows of x sorted by group (sizes_E rows each, summing to at most M) times their group's kernel: [M, O] in x's
    dtype (rows past the groups zero); m rows a tile."""
    with jax.named_scope(SCOPE):
        return _products(x_MxI, w_ExIxO, sizes_E, m)


def _forward(x_MxI, w_ExIxO, sizes_E, m):
    with jax.named_scope(SCOPE):
        return _products(x_MxI, w_ExIxO, sizes_E, m), (x_MxI, w_ExIxO, sizes_E)


def _backward(m, residuals, dy_MxO):
    """The input gradient, by the same tiles against the kernels transposed; the kernel gradient, its own scan
    (dropped by XLA where the kernel does not train)."""
    x_MxI, w_ExIxO, sizes_E = residuals
    with jax.named_scope(SCOPE):
        dx_MxI = _products(dy_MxO, jnp.swapaxes(w_ExIxO, 1, 2), sizes_E, m)
        dw_ExIxO = _kernel_gradient(x_MxI, dy_MxO, sizes_E, w_ExIxO.shape[0], m).astype(w_ExIxO.dtype)
    return dx_MxI, dw_ExIxO, None


tiled_grouped_matmul.defvjp(_forward, _backward)
