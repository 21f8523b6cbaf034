"""Cloud TPU slices as the TPU compiler sees them: an accelerator name (`v5e-8`, `v5p-128`, `v6e-256`, `v4-32`) ->
the slice's topology and hosts, and its devices from libtpu, on any host (no TPU needed).

    devices = topology_devices(tpu_slice(get_device("v5p-128")))   # 64 TpuDevices of a 4x4x4 v5p slice, 16 hosts

Each size's topology is Cloud TPU's ("TPU versions": v5e, v6e 2-D slices of chips, single-host up to 8 chips then
4 a host; v4, v5p, v7x 3-D slices counted in TensorCores, two a chip, 4 chips a host; a JAX device a chip on v4
("megacore") and v5p, a TensorCore on v7x, libtpu's "tpu7x"). `jax.experimental.topologies.get_topology_desc` turns
it into the slice's devices, whose `Mesh` compiles with the real TPU compiler (`planner/confirm.py`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jaxtune.errors import JaxtuneError
from jaxtune.planner.devices import Device

# chips -> the slice's shape, per dimensionality (Cloud TPU docs' accelerator-type tables)
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
             256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
GENERATIONS: dict[str, Mapping[int, tuple[int, ...]]] = {"v4": SHAPES_3D, "v5p": SHAPES_3D, "v5e": SHAPES_2D,
                                                         "v6e": SHAPES_2D, "v7x": SHAPES_3D}
# the most chips one host of the generation carries
SINGLE_HOST_CHIPS = {"v5e": 8, "v6e": 8, "v4": 4, "v5p": 4, "v7x": 4}
LIBTPU_NAMES = {"v7x": "tpu7x"}  # libtpu's topology names where they are not Cloud TPU's
DEVICES_PER_CHIP = {"v7x": 2}  # JAX devices a chip, where not one
INSTALL = 'pip install "jaxtune[tpu]" (libtpu, the TPU compiler; it runs on any Linux x86-64 host)'


@dataclass(frozen=True)
class TpuSlice:
    """A Cloud TPU slice: `generation` ("v5e", ...), `chips`, the topology `shape` and name libtpu takes
    ("v5p:4x4x4"), its hosts and JAX `devices` (a chip each; two on v7x)."""

    accelerator: str
    generation: str
    chips: int
    shape: tuple[int, ...]
    chips_per_host: int

    @property
    def topology(self) -> str:
        return f"{LIBTPU_NAMES.get(self.generation, self.generation)}:{'x'.join(map(str, self.shape))}"

    @property
    def devices(self) -> int:
        return self.chips * DEVICES_PER_CHIP.get(self.generation, 1)

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)


def tpu_slice(device: Device) -> TpuSlice:
    """The slice of a TPU target (`get_device("v5p-128")`: 64 chips; `get_device("v7x-64")`: 32 chips, 64 devices);
    a JaxtuneError naming the sizes Cloud TPU makes for a count it does not."""
    generation = device.name
    chips = device.count // DEVICES_PER_CHIP.get(generation, 1)
    shapes = GENERATIONS.get(generation)
    if device.family != "tpu" or shapes is None:
        raise JaxtuneError(f"{device.target} is not a TPU slice")
    per_chip = 2 if len(next(iter(shapes.values()))) == 3 else 1  # v4, v5p names count TensorCores
    name = f"{generation}-{chips * per_chip}"
    if chips not in shapes or chips * DEVICES_PER_CHIP.get(generation, 1) != device.count:
        sizes = ", ".join(f"{generation}-{n * per_chip}" for n in shapes)
        raise JaxtuneError(f"{name}: Cloud TPU makes no {generation} slice of {chips} chips; slices: {sizes}")
    single = SINGLE_HOST_CHIPS[generation]
    return TpuSlice(name, generation, chips, shapes[chips], chips if chips <= single else 4)


def topology_devices(slice_: TpuSlice, num_slices: int = 1) -> list:
    """The slice's devices from libtpu's topology description (one a chip; `num_slices` such slices joined over DCN,
    each device naming its `slice_index`), for a `Mesh` the TPU compiler compiles for; a JaxtuneError saying what
    to install where libtpu is missing. libtpu's start-up notices on a host without
    a TPU (its accelerator type and worker names) are kept off the terminal."""
    try:
        from jax.experimental import topologies
    except ImportError as e:  # an old jax
        raise JaxtuneError(f"this jax has no TPU topologies ({e}); {INSTALL}") from None
    # Only compiling: other processes may use libtpu at once (an xdist worker and the CLI it runs, a running
    # trainer), which its lockfile would refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs: dict[str, Any] = {"chip_config_name": "megacore"} if slice_.generation == "v4" else {}
    if num_slices > 1:
        kwargs["num_slices"] = num_slices
    if slice_.chips_per_host != 4 and len(slice_.shape) == 2:
        kwargs["chips_per_host_bounds"] = (*slice_.shape, 1)
    with libtpu_quiet() as said:
        try:
            devices = topologies.get_topology_desc(topology_name=slice_.topology, platform="tpu", **kwargs).devices
        except Exception as e:  # noqa: BLE001 - no TPU plugin ("Unknown backend tpu"), or libtpu refusing the name
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "tpu" in text.lower() and ("unknown" in text.lower() or "not found" in text.lower() or
                                          "plugin" in text.lower()) or "libtpu" in said():
                raise JaxtuneError(f"the TPU compiler is not installed here ({text}); {INSTALL}") from None
            raise JaxtuneError(f"{slice_.accelerator}: libtpu could not describe {slice_.topology!r}: {text}") from None
    if len(devices) != slice_.devices * num_slices:
        raise JaxtuneError(f"{slice_.accelerator}: libtpu's {slice_.topology} x {num_slices} has {len(devices)} "
                           f"devices, not {slice_.devices * num_slices}")
    return list(devices)


# What libtpu writes to file descriptor 2 on a host without a TPU: notices about the accelerator type and worker
# names it cannot find, which change nothing for compiling.
LIBTPU_NOTICES = ("Failed to find host bounds", "WARNING: Logging before InitGoogle", "TPU_WORKER_HOSTNAMES",
                  "=== Source Location Trace", "libtpu_init_utils", "TPU_ACCELERATOR_TYPE")


@contextmanager
def libtpu_quiet():
    """File descriptor 2 into a temporary file while the block runs (libtpu writes there directly, not through
    Python); afterwards every line but libtpu's start-up notices is written back. Yields a function that returns
    what was written so far."""
    with tempfile.TemporaryFile() as kept:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(kept.fileno(), 2)
        try:
            yield lambda: _read(kept)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            lines = _read(kept).splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not any(n in line for n in LIBTPU_NOTICES)))


def _read(kept) -> str:
    kept.seek(0)
    return kept.read().decode(errors="replace")


def describe(slice_: TpuSlice, num_slices: int = 1) -> str:
    """"v5p:4x4x4, 64 chips on 16 hosts" (", x 2 slices over DCN" for several) for reports."""
    several = f", x {num_slices} slices over DCN" if num_slices > 1 else ""
    return f"{slice_.topology}, {slice_.chips} chips on {slice_.hosts} host{'s' if slice_.hosts > 1 else ''}{several}"
