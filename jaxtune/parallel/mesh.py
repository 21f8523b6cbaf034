"""The device mesh: one `jax.sharding.Mesh` with named axes ("data", "fsdp", "tensor").

    data    plain data parallelism: parameters and optimizer state replicated, the batch split.
    fsdp    ZeRO-3: the batch split *and* parameters, gradients and optimizer state partitioned; XLA all-gathers
            a weight where it is used and reduce-scatters its gradient.
    tensor  tensor parallelism: attention heads, MLP columns and the vocabulary split (Megatron-style).

Which parameter dimension goes to which mesh axis is decided by one table, `jaxtune/parallel/rules.py`. Sizes
multiply to the number of devices; one of them may be -1, "the rest".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.parallel.rules import MESH_AXES


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; -1 takes the devices the others leave (at most one axis may say -1).

    The default puts every device on `fsdp`: ZeRO-3 over all devices, which is plain training on one device.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size == 0 or size < -1:
                raise ConfigError(name, size, "a mesh axis size is a positive integer, or -1 for the rest")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError("fsdp" if self.fsdp == -1 else "data", -1,
                              f"at most one mesh axis may be -1 ({self._describe()})")

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}

    def _describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.sizes().items())

    def resolve(self, num_devices: int) -> dict[str, int]:
        """The axis sizes for `num_devices` devices, -1 filled in; a JaxtuneError naming both when they don't fit."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes.values() if s != -1)
        if -1 in sizes.values():
            if num_devices % known:
                raise JaxtuneError(f"[mesh] {self._describe()}: {known} devices on the fixed axes do not divide the "
                                   f"{num_devices} devices available")
            sizes = {name: num_devices // known if s == -1 else s for name, s in sizes.items()}
        elif known != num_devices:
            raise JaxtuneError(f"[mesh] {self._describe()} needs {known} devices, but {num_devices} are available "
                               "(set one axis to -1 to take the rest)")
        return sizes


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A Mesh over `devices` (default: all of `jax.devices()`) with axes ("data", "fsdp", "tensor").

    `jax.make_mesh` orders the devices by the physical topology (rings on a TPU slice); `tensor` is the innermost
    axis, so tensor-parallel partners are neighbours, the pairs with the fastest links.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices))
    return jax.make_mesh([sizes[name] for name in MESH_AXES], MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def abstract_mesh(config: MeshConfig, num_devices: int) -> AbstractMesh:
    """The mesh `make_mesh` would build on `num_devices` devices, without any: shardings on it give per-device
    shapes (`NamedSharding.shard_shape`) for planning, e.g. a 70B model on 64 devices from a laptop."""
    sizes = config.resolve(num_devices)
    return AbstractMesh(tuple(sizes[name] for name in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))
