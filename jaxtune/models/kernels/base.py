"""What an attention kernel unit declares (`AttentionKernel`), and `choose_kernel`: the one predicate the forward
and the planner both ask of the registry (`kernels/__init__.py`) for a full forward's attention.

A kernel says which backends take it for `attention = "auto"`, why it cannot run a forward (`covers`, from static
facts: `AttentionShape`; `probe`, a trace-time check on its own backend), how it attends (`attend`), and what the
planner counts of it (`KernelCosts`). "blockwise" (`models/attention.py`) is no unit: every other kernel falls
back to it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.errors import ConfigError
from jaxtune.models.attention import AttentionMask

BLOCKWISE = "blockwise"


class AttentionShape(NamedTuple):
    """The static facts of a full forward's attention: B rows of T queries over S keys (S - T = prefix learned
    ones), K key/value heads each shared by G query heads of head_dim; packed segments or padding present; the
    scores' soft cap; the compute dtype; the model's distinct sliding windows (0: none); attention sinks present
    (gpt-oss's learned logit per query head in every softmax); bidirectional spans present (an image's tokens
    attending each other both ways, `span_ids_BxT`: no fused kernel computes them)."""

    B: int
    T: int
    S: int
    K: int
    G: int
    head_dim: int
    prefix: int
    packed: bool
    padded: bool
    softcap: float | None
    dtype: object
    windows: tuple[int, ...]
    sinks: bool
    spans: bool = False


class FusedAttention(NamedTuple):
    """A forward's fused kernel, static under jit. kind: the kernel's name; windows: the model's distinct sliding
    windows (0: none), each with its own kernel; masked: the batch has padding or packed segments; interpret: run
    it in Pallas' interpreter (off its backend: tests)."""

    kind: str
    windows: tuple[int, ...]
    masked: bool = False
    interpret: bool = False


class KernelCall(NamedTuple):
    """What `AttentionKernel.attend` gets beside q, k, v: the forward's mask, the layer's (traced) window, the live
    key blocks of each query block (the blockwise kernel's), the chosen kernel, the scores' scale and soft cap,
    `blockwise()`: the blockwise kernel's output for the same call (a kernel that falls back per batch), and the
    layer's attention sinks [K, G] or None."""

    mask: AttentionMask
    window: jax.Array
    live_QxC: jax.Array | None
    fused: FusedAttention
    scale: float
    softcap: float | None
    blockwise: Callable[[], jax.Array]
    sinks_KxG: jax.Array | None = None


class RingCall(NamedTuple):
    """What a ring kernel gets beside one device's queries and the step's key block: the ring's `ways` devices on
    mesh axis `axis`, the scores' scale and soft cap, and whether to run in Pallas' interpreter."""

    ways: int
    axis: str
    scale: float
    softcap: float | None
    interpret: bool


@dataclass(frozen=True)
class RingKernel:
    """A kernel's form as the per-block attention of a balanced context ring (`models/context_attention.py`, with
    no prefix keys or windows): attend(q, queries, keys, step, call: RingCall) -> (out, lse) float32 of the step's
    block; grads(q, queries, keys, step, out, lse, g, call) -> (dq, dk, dv) float32, given the whole attention's
    output and lse (the ring's layouts: `context_attention._attend`)."""

    attend: Callable
    grads: Callable


@dataclass(frozen=True)
class KernelCosts:
    """What the planner counts of a kernel where it runs on its own backend. workspace(b, heads, T, S, itemsize) ->
    bytes of one layer's attention backward in device memory (None: the blockwise kernel's, as measured); blocks(T,
    S) -> its (query, key) block sizes, whose causally dead pairs it skips (None: the blockwise kernel's);
    passes: its forward and backward in forwards (the blockwise kernel's 3)."""

    workspace: Callable[[int, int, int, int, int], int] | None = None
    blocks: Callable[[int, int], tuple[int, int]] | None = None
    passes: float = 3.0


@dataclass(frozen=True)
class AttentionKernel:
    """One fused attention kernel.

    name      the `attention` option value that asks for it
    platforms the backends where `attention = "auto"` takes it (where it covers the forward)
    covers    (shape) -> why it cannot run this forward, or None
    probe     (shape) -> why its backend refuses these shapes, found at trace time there (cuDNN's version), or None
    attend    (q [B, T, K, G, hd], k [B, S, K, hd], v [B, S, K, hd], call: KernelCall) -> [B, T, K, G, hd]
    off_platform  "interpret" (asked for off its backends, it runs in Pallas' interpreter) or "refuse", saying
              `runs_on` ("cuDNN runs on NVIDIA GPUs")
    ring      its per-block form for a context ring (`RingKernel`), None: the ring runs the blockwise kernel
    costs     what the planner counts of it
    """

    name: str
    platforms: tuple[str, ...]
    covers: Callable[[AttentionShape], str | None]
    attend: Callable[..., jax.Array]
    probe: Callable[[AttentionShape], str | None] | None = None
    off_platform: str = "refuse"
    runs_on: str = ""
    ring: RingKernel | None = None
    costs: KernelCosts = KernelCosts()


KERNELS: dict[str, AttentionKernel] = {}  # name -> unit, filled in one place: `kernels/__init__.py`


def kernel_choices() -> tuple[str, ...]:
    """Every value `attention` may take: "auto", "blockwise" and each registered kernel's name."""
    return ("auto", BLOCKWISE, *KERNELS)


def check_choice(choice: str) -> None:
    """A ConfigError naming `attention` and its valid values, for a choice no kernel answers to."""
    if choice not in kernel_choices():
        raise ConfigError("attention", choice, "choose one of " + ", ".join(kernel_choices()))


def choose_kernel(choice: str, shape: AttentionShape, platform: str, planning: bool = False
                  ) -> FusedAttention | None:
    """The fused kernel a full forward of `shape` on `platform` uses, or None for the blockwise kernel: the one
    decision the forward (`llama.decoder`) and the planner (`planner.kernels`) both take.

    choice: "auto" (the platform's kernel where it covers the forward), "blockwise", or a kernel's name: that kernel
    wherever it covers the forward (off its backends interpreted, or refused); a forward it cannot run (an eval
    batch of 64 tokens for splash, say) takes the blockwise kernel with a `FusedAttentionWarning` saying why.
    planning: the planner's question, off the platform's machine: no probe, no warning, and a kernel that would not
    run natively there counts as the blockwise kernel."""
    check_choice(choice)
    if choice == BLOCKWISE or shape.spans:
        return None
    if choice == "auto":
        kernel = next((k for k in KERNELS.values() if platform in k.platforms), None)
        if kernel is None:
            return None
    else:
        kernel = KERNELS[choice]
    native = platform in kernel.platforms
    if planning and not native:
        return None
    if not native and kernel.off_platform == "refuse":
        runs_on = kernel.runs_on or f"{kernel.name} runs on {', '.join(kernel.platforms)}"
        raise ConfigError("attention", choice, f"{runs_on}; this backend is {platform}")
    why = kernel.covers(shape)
    if why is None and native and not planning and kernel.probe is not None:
        why = kernel.probe(shape)
    if why is None:
        return FusedAttention(kernel.name, shape.windows, shape.packed or shape.padded, interpret=not native)
    if choice != "auto" and not planning:
        _warn_once(f'attention = "{choice}": the blockwise kernel runs a forward {kernel.name} cannot run: {why}')
    return None


class FusedAttentionWarning(UserWarning):
    """A fused attention kernel that was asked for could not run a forward."""


@functools.cache  # once a reason a process: a forward is traced for every batch shape
def _warn_once(message: str) -> None:
    warnings.warn(message, FusedAttentionWarning, stacklevel=4)


def by_window(window: jax.Array, windows: tuple[int, ...], run_with):
    """run_with(w) for the static w in `windows` that equals the traced `window` (a kernel takes its window
    statically: each distinct window gets its own, switched per layer)."""
    if len(windows) == 1:
        return run_with(windows[0])
    index = jnp.argmax(jnp.asarray(windows, jnp.int32) == window)
    return jax.lax.switch(index, [lambda w=w: run_with(w) for w in windows])
