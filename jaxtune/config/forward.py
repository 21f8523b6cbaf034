"""How (not what) the forward computes: compute dtype, rematerialisation, scanned layers. Static under `jax.jit`."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from jaxtune.errors import check_choice

REMAT_POLICIES = ("none", "full", "save_matmuls")


@dataclass(frozen=True)
class Remat:
    """What a layer keeps for the backward pass.

    "none": every activation is kept. "full": only the layer input; the block is recomputed.
    "save_matmuls": outputs of the weight matmuls are kept, attention and elementwise work is recomputed.
    """

    policy: str = "none"

    def __post_init__(self):
        policy = self.policy.replace("-", "_")
        if policy not in REMAT_POLICIES:
            check_choice("remat", self.policy, REMAT_POLICIES)
        object.__setattr__(self, "policy", policy)

    def wrap(self, fn):
        if self.policy == "none":
            return fn
        if self.policy == "full":
            return jax.checkpoint(fn, prevent_cse=False)
        return jax.checkpoint(fn, prevent_cse=False, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


@dataclass(frozen=True)
class ForwardOptions:
    """How (not what) the forward computes. Hashable, so it can be a static argument under `jax.jit`."""

    compute_dtype: str = "float32"
    remat: Remat = field(default_factory=Remat)
    scan_layers: bool = True
