"""The device mesh: one `jax.sharding.Mesh` with the five named axes of `MESH_AXES`, from `make_mesh` (or
`abstract_mesh`, without devices, for planning).

    data    plain data parallelism: parameters and optimizer state replicated, the batch split.
    fsdp    ZeRO-3: the batch split *and* parameters, gradients and optimizer state partitioned.
    expert  expert parallelism: a mixture's experts split E / expert a device, the batch split as over data.
    context each row's tokens split (context parallelism), and with fsdp ZeRO-3's partitions (`context_attention`).
    tensor  tensor parallelism: attention heads, MLP columns and the vocabulary split (Megatron-style).
Which dimension goes to which axis is one table, `parallel/rules.py`. One size may be -1, "the rest". `slices` > 1
(multi-slice TPU): `data` spans the slices over DCN, every other axis stays inside a slice."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxtune.config.run import MESH_AXES, MeshConfig
from jaxtune.errors import JaxtuneError


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A Mesh over `devices` (default: all of `jax.devices()`) with axes ("data", "fsdp", "expert", "context",
    "tensor").

    `jax.make_mesh` orders the devices by the physical topology (rings on a TPU slice); `tensor` is the innermost
    axis, so tensor-parallel partners are neighbours, the pairs with the fastest links. Sizes that do not tile the
    slice's physical axes (fsdp=16 x tensor=4 on a v6e-64's 8x8) split a physical axis instead of failing.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices))
    shape, types = [sizes[name] for name in MESH_AXES], (AxisType.Auto,) * len(MESH_AXES)
    if config.slices > 1:
        return Mesh(hybrid_device_grid(shape, config.slices, devices), MESH_AXES, axis_types=types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except NotImplementedError:  # axes that do not tile the slice's physical axes (fsdp=16 x tensor=4 on 8x8)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=types)


def hybrid_device_grid(shape: list[int], slices: int, devices: list):
    """The devices as a `shape` grid whose leading (data) axis is `slices` blocks, one a slice, each block laid out
    over its slice's own topology (`mesh_utils.create_hybrid_device_mesh`'s layout). A TPU device names its slice
    (`slice_index`); devices that do not (CPU, GPU) form `slices` equal blocks in their order."""
    from jax.experimental import mesh_utils

    if hasattr(devices[0], "slice_index"):
        granules: dict[int, list] = {}
        for device in devices:
            granules.setdefault(device.slice_index, []).append(device)
        blocks = [granules[key] for key in sorted(granules)]
    else:
        per_slice = len(devices) // slices
        blocks = [devices[i * per_slice:(i + 1) * per_slice] for i in range(slices)]
    if len(blocks) != slices or len({len(b) for b in blocks}) != 1:
        raise JaxtuneError(f"[mesh] slices = {slices}, but the {len(devices)} devices are in {len(blocks)} slice(s) "
                           f"of {sorted({len(b) for b in blocks})} devices")
    within = [shape[0] // slices, *shape[1:]]
    return np.concatenate([mesh_utils.create_device_mesh(within, block, allow_split_physical_axes=True)
                           for block in blocks], axis=0)


def abstract_mesh(config: MeshConfig, num_devices: int) -> AbstractMesh:
    """The mesh `make_mesh` would build on `num_devices` devices, without any: shardings on it give per-device
    shapes (`NamedSharding.shard_shape`) for planning, e.g. a 70B model on 64 devices from a laptop."""
    sizes = config.resolve(num_devices)
    return AbstractMesh(tuple(sizes[name] for name in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))
