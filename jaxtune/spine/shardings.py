"""Shardings of everything a training run holds, from the one rules table (`parallel/rules.py`): parameters
(`param_shardings`, method and quantised leaves included), optimizer state (`optimizer_shardings`: moments of
a parameter's shape as it, the rest replicated) and batches (`batch_sharding`: [A, B, T], B over data, fsdp, expert).

Logical axes come from `param_specs` for the base weights, `methods.transform.method_leaf_axes` for a method's leaves
(a LoRA A [L, in, r] splits as its kernel's input), and `extra_axes` for an objective's (a reward head); a leaf no
one declares is replicated. An `Int8Array` splits as its kernel; an `NF4Array`'s flat codes and absmax only in
ranges of whole blocks (`_quantized_sharding`). This module names no method.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import TypeAlias

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxtune.config import ModelConfig
from jaxtune.config.run import batch_ways
from jaxtune.errors import JaxtuneError
from jaxtune.methods.transform import method_leaf_axes
from jaxtune.models.params import logical_axes
from jaxtune.models.quant import ABSMAX_BLOCKSIZE, Int8Array, QuantizedArray, full_shape
from jaxtune.parallel.rules import mesh_axes_of, partition_spec, to_spec

AnyMesh: TypeAlias = Mesh | AbstractMesh  # shardings on an AbstractMesh give shapes for planning without devices

def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def _keys(path) -> tuple[str, ...]:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def leaf_axes(keys: tuple[str, ...], base_axes: dict, extra_axes: dict) -> tuple[str | None, ...] | None:
    """Logical axes of the leaf at dict path `keys` (a quantised kernel counts as its [L, in, out] kernel): the base
    model's, a method leaf's as the method declares them, or `extra_axes[keys]` (an objective's own leaves, e.g. a
    reward head); None for a leaf no one declares (it is then replicated).

    base_axes: `logical_axes(cfg)`, the base model's tree of axes.
    """
    node = base_axes
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            break
        node = node[key]
    else:
        return node if isinstance(node, tuple) else None
    return method_leaf_axes(keys, base_axes) or extra_axes.get(keys)


def replicated(mesh: AnyMesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# NF4 codes are each [out, in] matrix flattened (bitsandbytes' order), an absmax a block: only ranges of whole blocks
# keep a block with its absmax, so the flat axis takes the output dimension's mesh axes, then the input's (tensor
# splits the output columns as for a float kernel; fsdp splits output rows, not input rows). absmax2 splits alike
# when each device's absmax are whole groups, else is replicated; mesh axes that do not divide are dropped.
def _quantized_sharding(q: QuantizedArray, kernel_axes: tuple, mesh: AnyMesh) -> QuantizedArray:
    """The quantised leaf with a NamedSharding in place of each array child (see the module docstring)."""
    shape = full_shape(q)
    split = mesh_axes_of(kernel_axes, shape, mesh.shape)
    named = lambda spec: NamedSharding(mesh, spec)
    if isinstance(q, Int8Array):  # absmax [L, out] as the kernel's output axis, like DoRA's magnitude
        absmax_axes = tuple(kernel_axes[:-2]) + tuple(kernel_axes[-1:])
        absmax = partition_spec(absmax_axes, q.absmax.shape, mesh.shape)
        return dataclasses.replace(q, codes=named(to_spec(split)), absmax=named(absmax))
    d_in, d_out = q.shape
    n_blocks = q.absmax.shape[-1]
    flat: list[str] = []
    if (d_in * d_out) % q.blocksize == 0:
        for axis in split[-1] + split[-2]:  # output dimension first: the blocks run over the [out, in] matrix
            if n_blocks % (math.prod(mesh.shape[a] for a in flat) * mesh.shape[axis]) == 0:
                flat.append(axis)
    blocks = named(to_spec([()] * (q.codes.ndim - 1) + [tuple(flat)]))
    ways = math.prod(mesh.shape[a] for a in flat)
    groups = blocks if n_blocks % (ABSMAX_BLOCKSIZE * ways) == 0 else replicated(mesh)
    return dataclasses.replace(q, codes=blocks, absmax=blocks, absmax2=None if q.absmax2 is None else groups,
                               offset=None if q.offset is None else replicated(mesh))


def param_shardings(params: dict, cfg: ModelConfig, mesh: AnyMesh, extra_axes: dict | None = None) -> dict:
    """A NamedSharding for every array of `params` (arrays or ShapeDtypeStructs; None leaves stay None), in the
    tree's structure: a quantised leaf becomes the same NF4Array/Int8Array holding shardings. extra_axes: logical
    axes of leaves neither the model nor a method declares, by dict path (an objective's, e.g. a reward head)."""
    base_axes = logical_axes(cfg)

    def sharding(path, leaf):
        axes = leaf_axes(_keys(path), base_axes, extra_axes or {})
        if isinstance(leaf, QuantizedArray):
            if leaf.codes is None:  # the trainable half of `partition`: a quantised leaf with no arrays
                return leaf
            if axes is None:
                return jax.tree.map(lambda _: replicated(mesh), leaf)
            return _quantized_sharding(leaf, axes, mesh)
        if axes is None or len(axes) != leaf.ndim:
            return replicated(mesh)
        return NamedSharding(mesh, partition_spec(axes, leaf.shape, mesh.shape))

    return jax.tree_util.tree_map_with_path(sharding, params, is_leaf=_is_quantized)


def optimizer_shardings(optimizer: optax.GradientTransformation, params: dict, shardings: dict, mesh: AnyMesh):
    """Shardings of `optimizer.init(params)`: a state leaf of its parameter's shape, under that parameter's dict path
    (Adam's mu and nu, Muon's momentum, 8-bit codes), as the parameter; the rest (step counters, factored moments,
    block scales) replicated. `params` may be abstract."""
    abstract = jax.eval_shape(optimizer.init, params)
    by_path = {_keys(path): (tuple(p.shape), s) for (path, p), s in
               zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings))}
    rep = replicated(mesh)

    def sharding(path, leaf):
        keys = _keys(path)  # the parameter's path, after the keys of the optimizers wrapping it (optax.partition's)
        for start in range(len(keys)):
            shape, param_sharding = by_path.get(keys[start:], (None, None))
            if shape is not None:
                return param_sharding if tuple(leaf.shape) == shape else rep
        return rep

    return jax.tree_util.tree_map_with_path(sharding, abstract)


def batch_sharding(mesh: AnyMesh, batch_size: int) -> NamedSharding:
    """Sharding of [A, B, T] micro-batch stacks: rows split over ("data", "fsdp", "expert"), every row whole on a
    device.

    The loss is a sum over all rows divided by the global token count, so the split changes nothing numerically
    (beyond summation order); a batch that does not divide is an error, not a silent replication.
    """
    ways = batch_ways(mesh.shape)
    if batch_size % ways:
        raise JaxtuneError(f"train.batch_size = {batch_size} rows cannot be split over the mesh's data x fsdp x expert"
                           f" = {mesh.shape['data']} x {mesh.shape['fsdp']} x {mesh.shape['expert']} = {ways} devices; "
                           f"use a multiple of {ways}")
    return NamedSharding(mesh, partition_spec((None, "batch", None), (1, batch_size, 1), mesh.shape))


def sharded_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `shardings` (same structure);
    works on an `abstract_mesh`, so nothing needs to exist."""
    held = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, tree, shardings)
    return sum(jax.tree.leaves(held))


def bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s arrays held there}, read from each array's addressable shards."""
    held: dict = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(held)


def total_bytes(tree) -> int:
    """Bytes of `tree`'s arrays counted once (their global shapes); arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
