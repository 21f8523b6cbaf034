"""The device mesh: one `jax.sharding.Mesh` with the five named axes of `MESH_AXES`, from `make_mesh` (or
`abstract_mesh`, without devices, for planning).

    data    plain data parallelism: parameters and optimizer state replicated, the batch split.
    fsdp    ZeRO-3: the batch split *and* parameters, gradients and optimizer state partitioned.
    expert  expert parallelism: a mixture's experts split E / expert a device, the batch split as over data.
    context each row's tokens split (context parallelism), and with fsdp ZeRO-3's partitions (`context_attention`).
    tensor  tensor parallelism: attention heads, MLP columns and the vocabulary split (Megatron-style).
Which dimension goes to which axis is one table, `parallel/rules.py`. One size may be -1, "the rest".
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxtune.config.run import MESH_AXES, MeshConfig


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
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except NotImplementedError:  # axes that do not tile the slice's physical axes (fsdp=16 x tensor=4 on 8x8)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=types)


def abstract_mesh(config: MeshConfig, num_devices: int) -> AbstractMesh:
    """The mesh `make_mesh` would build on `num_devices` devices, without any: shardings on it give per-device
    shapes (`NamedSharding.shard_shape`) for planning, e.g. a 70B model on 64 devices from a laptop."""
    sizes = config.resolve(num_devices)
    return AbstractMesh(tuple(sizes[name] for name in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))
