"""A layer's rematerialisation under a `Remat` policy (`remat_layer`), with full remat keeping a 16-bit layer input
as its bits.

Full remat keeps only each layer's input, stacked by the layer scan, and recomputes the layer in the backward.
XLA:CPU converts a scanned bfloat16 residual stack to float32 before the backward loop (a float normalisation of
the loop's dynamic slice, hoisted out of the loop): twice the stack's bytes, alive through the loss and every
layer's backward. An integer stack is left alone, so here the layer input is kept as its uint16 bit pattern and
bitcast back in the backward, which is free on every backend and changes no value.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxtune.config import Remat


def remat_layer(block, remat: Remat, dtype):
    """`block(x, per_layer, shared) -> (x, aux)`, a layer scan's body (`shared`: what every layer reads), under
    `remat`; with full remat and a 16-bit `dtype` (x's), `x` is kept for the backward as its bits (see the module
    docstring); otherwise `remat.wrap(block)`."""
    if remat.policy != "full" or jnp.dtype(dtype).itemsize != 2:
        return remat.wrap(block)
    return partial(_bits_checkpoint, block)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bits_checkpoint(fn, x, per_layer, shared):
    return fn(x, per_layer, shared)


def _bits_checkpoint_fwd(fn, x, per_layer, shared):
    return fn(x, per_layer, shared), (jax.lax.bitcast_convert_type(x, jnp.uint16), per_layer, shared)


def _bits_checkpoint_bwd(fn, residuals, g):
    bits, per_layer, shared = residuals
    primal_x = jax.lax.bitcast_convert_type(bits, g[0].dtype)
    _, vjp = jax.vjp(fn, primal_x, per_layer, shared)
    return vjp(g)


_bits_checkpoint.defvjp(_bits_checkpoint_fwd, _bits_checkpoint_bwd)
