"""A layer's rematerialisation under a `Remat` policy (`remat_layer`), its 16-bit residuals kept as their bits.

XLA:CPU float-normalises a scanned bfloat16 residual stack: the forward's dynamic update slice converts the whole
stack to float32 and back at every layer (O(layers^2) work; benchmarks/README.md, issue 34), and the backward's
dynamic slice converts the whole stack before the loop (twice its bytes, alive through every layer's backward). An
integer stack is left alone, so under a 16-bit compute dtype a layer's backward residuals (with full remat, the layer
input) are kept as their uint16 bits and bitcast back in the backward: free on every backend, no value changed.
Remat "offload" keeps the layer input in pinned host memory on TPU and GPU (no bits there: no float-normalisation);
on a CPU, whose host memory is its device memory, it runs as "full" and says so once (`OFFLOAD_ON_CPU`).
"""

from __future__ import annotations

import warnings
from functools import cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.config import Remat
from jaxtune.errors import JaxtuneWarning
from jaxtune.parallel.rules import platform_in_context

OFFLOAD_ON_CPU = ('remat "offload": on a CPU host memory is device memory, so the layer inputs stay where they are '
                  '(run as remat "full")')


def remat_layer(block, remat: Remat, dtype):
    """`block(x, per_layer, shared) -> (x, aux)`, a layer scan's body (`shared`: what every layer reads), under
    `remat` (`remat.wrap(block)`); with a 16-bit `dtype` (x's), its 16-bit residuals are kept as their bits (see
    the module docstring)."""
    if remat.policy == "offload":
        if platform_in_context() != "cpu":
            return remat.wrap(block)
        _say_offload_is_full_on_cpu()
        remat = Remat("full")
    if jnp.dtype(dtype).itemsize != 2:
        return remat.wrap(block)
    return partial(_bits_residuals, remat.wrap(block))


@cache
def _say_offload_is_full_on_cpu() -> None:
    warnings.warn(OFFLOAD_ON_CPU, JaxtuneWarning, stacklevel=4)


class _Bits(NamedTuple):
    """A 16-bit float residual as its uint16 bits, and an empty array of its dtype."""

    bits: jax.Array
    like: jax.Array


def _keep(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return _Bits(jax.lax.bitcast_convert_type(x, jnp.uint16), jnp.zeros((0,), x.dtype))
    return x


def _kept(x):
    return jax.lax.bitcast_convert_type(x.bits, x.like.dtype) if isinstance(x, _Bits) else x


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bits_residuals(fn, x, per_layer, shared):
    return fn(x, per_layer, shared)


def _bits_residuals_fwd(fn, x, per_layer, shared):
    out, vjp = jax.vjp(fn, x, per_layer, shared)
    return out, jax.tree.map(_keep, vjp)


def _bits_residuals_bwd(fn, residuals, g):
    return jax.tree.map(_kept, residuals, is_leaf=lambda r: isinstance(r, _Bits))(g)


_bits_residuals.defvjp(_bits_residuals_fwd, _bits_residuals_bwd)
