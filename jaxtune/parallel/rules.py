"""One table from logical axis names to mesh axes (`RULES`), and `partition_spec(axes, shape, mesh_shape)`, which turns
a leaf's logical axes into a PartitionSpec; `constrain` and `gathered` apply the table to activations and weights.

Every dimension has a logical name (`models/params.py`; method and quantised leaves: `spine/shardings.py`). A rule
gives the mesh axes that split its name, and fallbacks used only where no other dimension of the leaf took them, so
a q_proj kernel (layers, embed, q_heads) splits (-, fsdp, tensor) while a LoRA B (layers, lora_rank, q_heads) still
spreads over every device (-, -, tensor x fsdp). Two passes (split-over axes, then fallbacks), in table order: a
dimension takes a mesh axis if it is above 1, no other dimension has that axis, and the split divides it; else it
stays whole (replicated), never padded. `tests/test_parallel.py` checks the bytes a device holds on Llama-3-8B.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from jaxtune.config.run import MESH_AXES

Rule = tuple[str, tuple[str, ...], tuple[str, ...]]
ZERO_AXES = ("fsdp", "context")  # the mesh axes that partition parameters, gradients and optimizer state (ZeRO-3)

# batch: over every data-parallel device; seq (a row's tokens) over context; rows (the head's): fsdp splits its
# vocabulary instead; experts: E / expert a device; embed over fsdp and context (ZeRO-3: `ZERO_AXES`); heads, MLP
# columns, vocabulary over tensor (Megatron); table_embed (the table's and head's hidden size) only where the
# vocabulary cannot be split; layers never (`lax.scan` slices them).
RULES: tuple[Rule, ...] = (
    # logical axis   split over          fallback
    ("batch", ("data", "fsdp", "expert"), ()),
    ("seq", ("context",), ()),
    ("rows", ("data", "expert"), ()),
    ("experts", ("expert",), ()),
    ("embed", ("fsdp", "context"), ("tensor",)),
    ("vocab", ("tensor",), ("fsdp", "context")),
    ("table_embed", (), ("fsdp", "context", "tensor")),
    ("q_heads", ("tensor",), ("fsdp", "context")),
    ("kv_heads", ("tensor",), ("fsdp", "context")),
    ("mlp", ("tensor",), ("fsdp", "context")),
    ("adapter", ("tensor",), ("fsdp", "context")),
    ("head_dim", (), ("fsdp", "context", "tensor")),
    ("layers", (), ()),
    ("lora_rank", (), ()),
    ("prefix", (), ()),
)


def mesh_axes_of(axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int],
                 rules: Sequence[Rule] = RULES) -> list[tuple[str, ...]]:
    """The mesh axes splitting each dimension (an empty tuple: not split), by the procedure in the module doc.

    axes: one logical name (or None: never split) per dimension of `shape`.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    known = {rule[0] for rule in rules}
    unknown = [a for a in axes if a is not None and a not in known]
    if unknown:
        raise ValueError(f"no sharding rule for logical axis {unknown[0]!r} (rules: {', '.join(sorted(known))})")
    taken: list[list[str]] = [[] for _ in axes]
    used: set[str] = set()
    for pass_ in (1, 2):
        for name, *candidates in rules:
            for dim, axis in enumerate(axes):
                if axis != name:
                    continue
                for mesh_axis in candidates[pass_ - 1]:
                    size = mesh_shape.get(mesh_axis, 1)
                    split = math.prod(mesh_shape[a] for a in taken[dim]) * size
                    if size > 1 and mesh_axis not in used and shape[dim] % split == 0:
                        taken[dim].append(mesh_axis)
                        used.add(mesh_axis)
    return [tuple(t) for t in taken]


def to_spec(mesh_axes: Sequence[tuple[str, ...]]) -> PartitionSpec:
    """[(), ("fsdp",), ("tensor", "fsdp")] -> P(None, "fsdp", ("tensor", "fsdp"))."""
    return PartitionSpec(*[None if not m else m[0] if len(m) == 1 else tuple(m) for m in mesh_axes])


def partition_spec(axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int],
                   rules: Sequence[Rule] = RULES) -> PartitionSpec:
    """The PartitionSpec of a leaf with logical `axes` and `shape` on a mesh of `mesh_shape` (name -> size; an axis
    left out has size 1).

    >>> partition_spec(("layers", "embed", "q_heads"), (32, 4096, 4096), {"data": 1, "fsdp": 4, "tensor": 2})
    P(None, 'fsdp', 'tensor')
    >>> partition_spec(("layers", "lora_rank", "q_heads"), (32, 16, 4096), {"data": 1, "fsdp": 4, "tensor": 2})
    P(None, None, ('tensor', 'fsdp'))
    >>> partition_spec(("layers", "embed", "lora_rank"), (32, 4096, 16), {"data": 1, "fsdp": 4, "tensor": 2})
    P(None, ('fsdp', 'tensor'), None)
    """
    return to_spec(mesh_axes_of(axes, shape, mesh_shape, rules))


def constrain(x, axes: Sequence[str | None]):
    """`x` split as the rules split a leaf with logical `axes` on the mesh in context, or `x` itself when there is
    none (plain `jit`, one device, generation) or it lacks jaxtune's axes.

    Used on activations: `shard_train_step` traces the step under its mesh (`jax.sharding.use_abstract_mesh`), and
    the decoder pins each layer input to ("batch", None, None), its rows split over ("data", "fsdp", "expert").
    Without it XLA's propagation gives activations the embedding table's split (hidden size over fsdp) and every
    device computes and holds the whole micro-batch (measured: 1.15-4.3x the memory on 2-8 fake CPU devices).
    """
    mesh = mesh_in_context()
    return x if mesh is None else jax.lax.with_sharding_constraint(x, partition_spec(axes, x.shape, mesh.shape))


PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}  # JAX's device platforms -> its backend names


def platform_in_context() -> str:
    """The platform a step is compiled for: that of the mesh it is traced under (its devices' kind, which a TPU
    slice's topology gives on any host), else the default backend's. Kernels are chosen by it, not by the host."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return PLATFORMS.get(platform, platform)


def mesh_in_context():
    """The abstract mesh a step is traced under, or None: none, one device, or not jaxtune's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 or not set(MESH_AXES) <= set(mesh.axis_names) else mesh


def zero_only_dim(axes: tuple[str | None, str | None], shape: tuple[int, int]) -> int | None:
    """The dimension of a matrix with logical `axes` and `shape` that the mesh in context splits over ZeRO-3's axes
    alone (fsdp, context), the other dimension whole (so pieces of that one can be cut on every device alike), or
    None."""
    mesh = mesh_in_context()
    if mesh is None:
        return None
    split = mesh_axes_of(axes, shape, mesh.shape)
    return next((d for d in (0, 1) if split[d] and set(split[d]) <= set(ZERO_AXES) and not split[1 - d]), None)


def context_ways() -> int:
    """How many devices share each row's tokens on the mesh in context (its `context` axis; 1 without a mesh)."""
    mesh = mesh_in_context()
    return 1 if mesh is None else mesh.shape["context"]


def head_rows(vocab: int) -> str:
    """The logical axis of the head's rows: "rows" (split over data only) when the mesh in context splits a
    vocabulary of `vocab` over fsdp, so each device computes every row's logits for its share of the vocabulary;
    else "batch", each device its own rows."""
    mesh = mesh_in_context()
    vocab_axes = () if mesh is None else mesh_axes_of(("vocab",), (vocab,), mesh.shape)[0]
    return "rows" if "fsdp" in vocab_axes else "batch"


def gathered(x, axes: Sequence[str | None]):
    """`x`, a weight with logical `axes`, all-gathered over fsdp and context where it is used (ZeRO-3) and still split
    over tensor as the rules split it; `x` itself where no mesh is in context (see `constrain`).

    Pinning the gather to the weight as stored keeps it in the stored dtype: left to XLA:CPU, a frozen bfloat16
    kernel was converted to float32 on its shard and gathered in float32 (twice the traffic and the memory)."""
    mesh = mesh_in_context()
    if mesh is None:
        return x
    spec = mesh_axes_of(axes, x.shape, mesh.shape)
    return jax.lax.with_sharding_constraint(x, to_spec([tuple(a for a in dim if a not in ZERO_AXES) for dim in spec]))
