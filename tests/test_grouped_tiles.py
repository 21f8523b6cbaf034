"""The tiled grouped matmul (`models/grouped_tiles.py`) against a float64 numpy reference: forward, input gradient
and kernel gradient, with empty groups, every row in one group, rows past the groups and tiles left part-full."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.models.grouped_tiles import tiled_grouped_matmul


def reference(x, w, sizes, dy):
    """(y, dx, dw) in float64: each row of x times its group's kernel; rows past the groups zero."""
    group = np.repeat(np.arange(len(sizes)), sizes)
    y, dx, dw = np.zeros((len(x), w.shape[2])), np.zeros(x.shape), np.zeros(w.shape)
    for r, g in enumerate(group):
        y[r], dx[r] = x[r] @ w[g], w[g] @ dy[r]
        dw[g] += np.outer(x[r], dy[r])
    return y, dx, dw


@pytest.mark.parametrize("sizes", [(5, 0, 9, 0, 7), (0, 21, 0, 0, 0), (1, 1, 1, 1, 17), (3, 0, 8, 2, 4)],
                         ids=["empty groups", "one group", "single rows", "rows past the groups"])
def test_tiled_grouped_matmul_matches_a_float64_reference(sizes):
    rng = np.random.default_rng(sum(sizes))
    rows, width_in, width_out = 21, 6, 5  # 21 rows: two full tiles of 8 and one of 5
    x, dy = rng.standard_normal((rows, width_in)), rng.standard_normal((rows, width_out))
    w = rng.standard_normal((len(sizes), width_in, width_out))
    sizes_E = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda x, w: tiled_grouped_matmul(x, w, sizes_E, 8))
    y, vjp = jax.vjp(f, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    for got, want in zip((y, *vjp(jnp.asarray(dy, jnp.float32))), reference(x, w, np.asarray(sizes), dy)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
