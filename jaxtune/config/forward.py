"""How (not what) the forward computes: compute dtype, rematerialisation, scanned layers, the attention kernel.
Static under `jax.jit`."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from jaxtune.errors import check_choice, check_range

REMAT_POLICIES = ("none", "full", "save_matmuls")
# the attention kernel of a full forward (`models/fused_attention.py`): "auto" takes the backend's fused kernel
# where it covers the mask (splash on TPU, cuDNN on NVIDIA GPUs), else the blockwise one
ATTENTION_KERNELS = ("auto", "blockwise", "splash", "cudnn")
# how attention crosses a `context` mesh axis (`models/context_attention.py`): key/value blocks passed around a ring,
# or all of them gathered on every device
CONTEXT_ATTENTION = ("ring", "all_gather")
# the name of `models.linear.matmul`'s output, which "save_matmuls" keeps: a policy that saves dots sees no dot
# inside a custom_vjp, and the projections' matmuls are custom_vjps
MATMUL_OUTPUT = "matmul"


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
        policies = jax.checkpoint_policies
        keep = policies.save_from_both_policies(policies.save_only_these_names(MATMUL_OUTPUT),
                                                policies.dots_with_no_batch_dims_saveable)
        return jax.checkpoint(fn, prevent_cse=False, policy=keep)


@dataclass(frozen=True)
class ForwardOptions:
    """How (not what) the forward computes. Hashable, so it can be a static argument under `jax.jit`.

    context_attention: "ring" or "all_gather", on a mesh with a `context` axis. tiled_mlp: tokens a row per tile of
    the MLP, each tile recomputed in the backward (0: the whole sequence at once)."""

    compute_dtype: str = "float32"
    remat: Remat = field(default_factory=Remat)
    scan_layers: bool = True
    attention: str = "auto"
    context_attention: str = "ring"
    tiled_mlp: int = 0

    def __post_init__(self):
        check_choice("attention", self.attention, ATTENTION_KERNELS)
        check_choice("context_attention", self.context_attention, CONTEXT_ATTENTION)
        check_range("tiled_mlp", self.tiled_mlp, 0)
