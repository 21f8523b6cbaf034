"""The arrays one training step holds, per device, counted exactly on the spine's abstract run on an
`AbstractMesh`: frozen weights in their dtype (QLoRA's packed leaves), float32 trainable copies, the optimizer's
state and its update's temporaries, the second model, the batch, and what loading holds beside them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import numpy as np
from optax.contrib import MuonDimensionNumbers

from jaxtune.config import MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.methods.transform import parameter_report
from jaxtune.models.params import abstract_params, count_params
from jaxtune.models.quant import (
    NF4_BLOCKSIZE,
    Int8Array,
    QuantizedArray,
    full_shape,
    nf4_codes,
    quantize_int8,
    row_slices,
)
from jaxtune.parallel.mesh import abstract_mesh
from jaxtune.spine.optimizers import QuantizedMoment, layer_stacked, muon_dimensions, row_chunks, scale_by_adam_8bit
from jaxtune.spine.run import abstract_run


def tiled_bytes(shape, itemsize: int, stored: bool = False) -> int:
    """Bytes of an array laid out in (rows, 128) tiles over its last two dimensions, in the order that pads least
    (the TPU compiler lays a [D, r] LoRA factor out with D minor); a `stored` array (a weight, a moment) over any
    two of its dimensions (QLoRA's expert codes [L, E, n] are laid out over (L, n) rather than padding E = 8 to 32
    rows). Measured, experiments/tpu_compile_table.py."""
    shape = tuple(shape) if len(shape) > 1 else (1, *shape) if shape else (1, 1)
    if not math.prod(shape):
        return 0
    rows = 8 * max(1, 4 // itemsize)
    padded = lambda sublanes, lanes: (-(-sublanes // rows) * rows) * (-(-lanes // 128) * 128)  # noqa: E731
    n = len(shape)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j] if stored else [(n - 2, n - 1), (n - 1, n - 2)]
    return itemsize * min(padded(shape[i], shape[j]) * math.prod(shape) // (shape[i] * shape[j]) for i, j in pairs)


def device_bytes(tree, tiled: bool) -> int:
    """Bytes of one device's shard of every array of an abstract tree whose leaves carry their shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(tuple(leaf.shape))
        itemsize = np.dtype(leaf.dtype).itemsize
        total += tiled_bytes(shape, itemsize, stored=True) if tiled else math.prod(shape) * itemsize
    return total


@dataclass(frozen=True)
class RunBytes:
    """Per-device bytes of the arrays a step holds, counted on the spine's own abstract run (exact)."""

    frozen: int
    trainable: int
    optimizer: int
    second: int
    batch: int
    parameters: int
    trainable_parameters: int
    base_parameters: int
    loading_device: int
    loading_host: int
    largest_trainable: int  # the largest trainable leaf outside the layer stacks, whole
    optimizer_temporaries: int = 0  # the update's working copies (`_optimizer_temporaries`)


def run_bytes(cfg: ModelConfig, plan: TrainPlan, sizes: dict, tiled: bool) -> RunBytes:
    """The spine's abstract run of `plan` on an abstract mesh of `sizes`: what each argument of the step holds per
    device. Cached on what changes the arrays (not remat or the compute dtype)."""
    return _run_bytes(cfg, plan.replace(remat="none", compute_dtype="float32"), tuple(sizes.items()), tiled)


@functools.lru_cache(maxsize=512)
def _run_bytes(cfg, plan, sizes, tiled) -> RunBytes:
    sizes = dict(sizes)
    mesh = abstract_mesh(MeshConfig(**sizes), math.prod(sizes.values()))
    run = abstract_run(cfg, plan, mesh)
    trainable = sum(math.prod(x.shape) for x in jax.tree.leaves(run.state["params"]))
    report = parameter_report(run.params, plan.method, cfg, run.objective.head_leaves)
    return RunBytes(device_bytes(run.frozen, tiled), device_bytes(run.state["params"], tiled),
                    device_bytes(run.state["opt_state"], tiled), device_bytes(run.second, tiled),
                    device_bytes(run.batch, tiled), report.total, trainable, count_params(abstract_params(cfg)),
                    *_loading_transient(run, tiled),
                    _largest_outside_layers(run.state["params"]),
                    _optimizer_temporaries(plan.optimizer, run.state["params"], tiled))


# The update's temporaries beyond the gradients, as (copies of a device's bytes of the leaves each optimizer works
# on, and copies of one layer's slice of them). XLA:CPU (the update alone after clipping, compiled at 4 and 16
# layers): optax's Adafactor keeps a float32 copy of every update; Muon and the 8-bit AdamW run layer by layer
# (`spine.optimizers.by_layer`) and keep the clipped gradients and the step whole (Muon also a copy of its
# momentum), plus one layer's Newton-Schulz products or dequantised moments. The TPU compiler (libtpu, a full
# fine-tune's step on v5e-4 at 4 and 12 layers, against AdamW's): Adafactor and Muon fuse their updates; the 8-bit
# AdamW's layer loop re-lays each fsdp-split layer into blocks of 256. AdamW updates in place on both. GPUs (not
# measured) are counted as the CPU.
UPDATE_COPIES = {"cpu": {"adafactor": (1.0, 0.0), "muon": (2.75, 4.2), "adamw_8bit": (1.0, 3.2)},
                 "tpu": {"adafactor": (0.0, 0.0), "muon": (0.0, 3.3), "adamw_8bit": (0.3, 21.0)}}


def _optimizer_temporaries(optimizer: str, params, tiled: bool) -> int:
    """Bytes on one device of the optimizer update's temporaries (`UPDATE_COPIES`)."""
    copies = UPDATE_COPIES["tpu" if tiled else "cpu"]  # tiled: a TPU's layouts
    if optimizer not in copies:
        return 0
    if optimizer == "muon":
        dims = muon_dimensions(params)
        params = jax.tree.map(lambda x, d: None if d is None else x, params, dims,
                              is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    elif optimizer == "adamw_8bit":
        params = jax.tree.map(lambda x, m: x if isinstance(m, QuantizedMoment) else None, params,
                              jax.eval_shape(scale_by_adam_8bit(0.9, 0.999, 1e-8).init, params).mu,
                              is_leaf=lambda x: isinstance(x, QuantizedMoment))
    whole, per_layer = copies[optimizer]
    total = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:  # outside the stacks: 8-bit's row chunks
        pieces = x.shape[0] if layer_stacked(path) else row_chunks(math.prod(x.shape))
        total += (whole + per_layer / pieces) * device_bytes([x], tiled)
    return int(total)


def _largest_outside_layers(params) -> int:
    """Bytes of the largest trainable leaf outside the layer stacks (the head, the embedding table): its gradient
    is summed whole on each device before an fsdp mesh splits it. A stacked layer's gradient is split inside the
    layer scan, one layer at a time (a 70B full fine-tune's [80, 8192, 28672] MLP stack is no such leaf)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    outside = [x for path, x in leaves if not any(getattr(k, "key", None) == "layers" for k in path)]
    return max((math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in outside), default=0)


def _loading_transient(run, tiled: bool) -> tuple[int, int]:
    """(device, host) bytes `spine/load.py` holds beside the arrays it has created. A quantised kernel: on the
    device, one slice of rows being quantised (its compiled program's own figures); on the host, all that kernel's
    layers' quantised children (placed at the end) and the slice as read. A float leaf: one shard being read, on
    the host and on the device."""
    quantized = [x for x in jax.tree.leaves(run.frozen, is_leaf=lambda x: isinstance(x, QuantizedArray))
                 if isinstance(x, QuantizedArray) and x.codes is not None]
    if quantized:
        host = max(sum(math.prod(c.shape) * np.dtype(c.dtype).itemsize for c in jax.tree.leaves(q)) for q in quantized)
        slices = []
        for q in quantized:
            d_in, d_out = full_shape(q)[-2:]  # [L, in, out], or [L, E, in, out] for a mixture's experts
            int8 = isinstance(q, Int8Array)
            start, stop = row_slices(d_out, d_in, 1 if int8 else NF4_BLOCKSIZE)[0]
            slices.append(((stop - start, d_in), np.dtype(q.dtype).name, int8))
        device = max(_quantizer_bytes(*s) for s in slices)
        read = max(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype, _ in slices)
        return device, host + read
    leaves = jax.tree.leaves(run.frozen) + jax.tree.leaves(run.state["params"])
    shard = max((device_bytes(x, tiled) for x in leaves), default=0)
    return shard, shard


@functools.lru_cache(maxsize=64)
def _quantizer_bytes(slice_shape: tuple[int, int], dtype: str, int8: bool) -> int:
    """Argument + output + temporary bytes of the compiled quantiser on one [rows, in] slice of a weight's torch
    layout, as `models/quant.quantize_by_rows` runs it."""
    rows, d_in = slice_shape
    if int8:
        lowered = jax.jit(quantize_int8).lower(jax.ShapeDtypeStruct((d_in, rows), dtype))
    else:
        lowered = nf4_codes.lower(jax.ShapeDtypeStruct((1, rows * d_in), dtype))
    memory = lowered.compile().memory_analysis()
    return memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
