"""How (not what) the forward computes: compute dtype, rematerialisation, scanned layers, the attention kernel.
Static under `jax.jit`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtune.errors import ConfigError, check_choice, check_range

REMAT_POLICIES = ("none", "full", "save_matmuls", "offload")
# the dtype of activations and matmuls: "auto" is what the devices multiply fast (bfloat16 on accelerators, float32
# on CPUs, `ForwardOptions.dtype`); "float64" is the tests' reference numerics, under `jax.enable_x64`
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float64")
# how attention crosses a `context` mesh axis (`models/context_attention.py`): key/value blocks passed around a ring,
# or all of them gathered on every device
CONTEXT_ATTENTION = ("ring", "all_gather")
# the name of `models.linear.matmul`'s output, which "save_matmuls" keeps: a policy that saves dots sees no dot
# inside a custom_vjp, and the projections' matmuls are custom_vjps
MATMUL_OUTPUT = "matmul"
# the name of a layer's input, which "offload" sends to pinned host memory in the forward and fetches back for the
# layer's backward (MaxText's `remat_policy = "offload"` does this to its "decoder_layer_input")
LAYER_INPUT = "layer_input"


@dataclass(frozen=True)
class Remat:
    """What a layer keeps for the backward pass.

    "none": every activation is kept. "full": only the layer input; the block is recomputed.
    "save_matmuls": outputs of the weight matmuls are kept, attention and elementwise work is recomputed.
    "offload": as "full", but the layer input is kept in pinned host memory: copied there in the forward, back in
    the layer's backward (XLA overlaps both with the layers' compute; TPU and GPU; a CPU's host memory is its device
    memory, so there it runs as "full", `models/remat.py`).
    """

    policy: str = "none"

    def __post_init__(self):
        policy = self.policy.replace("-", "_")
        if policy not in REMAT_POLICIES:
            check_choice("remat", self.policy, REMAT_POLICIES)
        object.__setattr__(self, "policy", policy)

    @property
    def recomputes(self) -> str:
        """What the layer's backward recomputes, as the policy that keeps the same on the device: "full" for
        "offload"."""
        return "full" if self.policy == "offload" else self.policy

    def wrap(self, fn):
        """`fn(x, *rest)`, a layer, under this policy (`jax.checkpoint`)."""
        if self.policy == "none":
            return fn
        if self.policy == "full":
            return jax.checkpoint(fn, prevent_cse=False)
        policies = jax.checkpoint_policies
        if self.policy == "offload":
            to_host = policies.save_and_offload_only_these_names(
                names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,), offload_src="device",
                offload_dst="pinned_host")
            named = lambda x, *rest: fn(jax.tree.map(lambda a: checkpoint_name(a, LAYER_INPUT), x), *rest)  # noqa: E731
            return jax.checkpoint(named, prevent_cse=False, policy=to_host)
        keep = policies.save_from_both_policies(policies.save_only_these_names(MATMUL_OUTPUT),
                                                policies.dots_with_no_batch_dims_saveable)
        return jax.checkpoint(fn, prevent_cse=False, policy=keep)


@dataclass(frozen=True)
class ForwardOptions:
    """How (not what) the forward computes, each knob declared here once: `[model]` in a run's TOML holds them beside
    its own keys, a `TrainPlan` holds the options its step runs with. Hashable: a static argument under `jax.jit`.

    compute_dtype: of activations and matmuls (`COMPUTE_DTYPES`). remat: what a layer keeps for the backward.
    scan_layers: the layers run under one `lax.scan` (False: unrolled; tests). attention: the kernel of a full
    forward, "auto" (the backend's fused kernel where it covers the mask), "blockwise" or a registered kernel's name
    (`models/kernels/`, which checks it). context_attention: "ring" or "all_gather", on a mesh with a `context` axis.
    tiled_mlp: tokens a row per tile of the MLP, each tile recomputed in the backward (0: the whole sequence at once).
    """

    compute_dtype: str = "float32"
    remat: Remat = field(default_factory=Remat)
    scan_layers: bool = True
    attention: str = "auto"
    context_attention: str = "ring"
    tiled_mlp: int = 0

    def __post_init__(self):
        check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        if isinstance(self.remat, str):  # as TOML and `--set` give it
            object.__setattr__(self, "remat", Remat(self.remat))
        check_choice("context_attention", self.context_attention, CONTEXT_ATTENTION)
        check_range("tiled_mlp", self.tiled_mlp, 0)

    def dtype(self, platform: str) -> jnp.dtype:
        """The compute dtype on `platform` ("cpu", "gpu", "tpu", ...): "auto" is float32 on a CPU (bfloat16 is
        emulated on most), bfloat16 on an accelerator; "float64" only under `jax.enable_x64`."""
        name = self.resolved(platform).compute_dtype
        if name == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("compute_dtype", name, "is the tests' reference numerics: it needs jax.enable_x64")
        return jnp.dtype(name)

    def resolved(self, platform: str) -> ForwardOptions:
        """The same options with "auto" compute made the platform's dtype (`dtype`)."""
        if self.compute_dtype != "auto":
            return self
        return dataclasses.replace(self, compute_dtype="float32" if platform == "cpu" else "bfloat16")
