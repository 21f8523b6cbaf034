"""ZeRO-offload the JAX way: optimizer state and frozen weights kept in host memory between steps.

An array whose sharding says `memory_kind="pinned_host"` (`HOST`; `with_memory_kind`) lives in page-locked host RAM
with the same mesh split as on the devices. The jitted step copies such arguments to device memory where it first
reads them (`on_device`, inside the jit, so XLA schedules the copies) and its out_shardings write the new optimizer
state straight back: device memory holds the offloaded trees only while a step runs. A backend without pinned host
memory is an error (`check_host_memory`), never a silent fallback. `low_precision_moments` stores Adam's moments in
bfloat16 between steps (the update runs in float32); what that does to the loss: experiments/bf16_moments.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh

from jaxtune.errors import JaxtuneError

HOST = "pinned_host"
DEVICE = "device"


def memory_kinds(mesh: Mesh | AbstractMesh) -> tuple[str, ...] | None:
    """The memory kinds the devices of `mesh` have; None for an AbstractMesh (no devices to ask)."""
    if isinstance(mesh, AbstractMesh):
        return None
    try:
        return tuple(m.kind for m in mesh.devices.flat[0].addressable_memories())
    except Exception:  # backends without the memories API
        return ()


def check_host_memory(mesh: Mesh | AbstractMesh, what: str) -> None:
    """A JaxtuneError naming the backend and its memory kinds when it cannot hold arrays in pinned host memory."""
    kinds = memory_kinds(mesh)
    if kinds is not None and HOST not in kinds:
        platform = mesh.devices.flat[0].platform
        raise JaxtuneError(f"[offload] {what} = true: the {platform} backend has no {HOST!r} memory "
                           f"(memory kinds: {', '.join(kinds) or 'none'}); set it to false")


def with_memory_kind(shardings, kind: str):
    """The same tree of shardings, every one placed in memory `kind`."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def on_device(tree, shardings):
    """Inside a jit: the arrays of `tree` whose sharding is in host memory, copied to device memory (others as is)."""

    def fetch(x, sharding):
        return jax.device_put(x, sharding.with_memory_kind(DEVICE)) if sharding.memory_kind == HOST else x

    return jax.tree.map(fetch, tree, shardings)


# A bfloat16 moment whose change in a step is below half an ulp of itself does not move: Adam's second moment
# (b2 = 0.999) then stops following slow drifts of the gradient scale (experiments/bf16_moments.py).
def low_precision_moments(optimizer: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`optimizer` with every floating leaf of its state (Adam's mu and nu) stored in `dtype`.

    The wrapped update reads the state as float32 and rounds only the state it returns, so each step's arithmetic
    is unchanged; integer counters are left alone. optax's own `mu_dtype` covers only the first moment.
    """
    dtype = jnp.dtype(dtype)

    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(optimizer.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = optimizer.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)
