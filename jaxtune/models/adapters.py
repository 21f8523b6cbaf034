"""Where a fine-tuning method enters the forward pass: hook tables that `jaxtune.methods`' units fill.

`DENSE_HOOKS[leaf]` runs in `linear.dense` wherever a module holds that leaf (LoRA's `lora_a`, IA3's `ia3_in` /
`ia3_out`); `ADAPTER_FORWARDS[kind]` gives a method's dropout rate and per-module, per-layer scales. The forward
names no method: a kind without a registered entry fails loudly (`adapter_forward`). Prefix keys (`prefix`) and
bottleneck adapters (`attn_adapter`, `mlp_adapter`) have fixed places in `llama.py`'s layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError


class Branch(NamedTuple):
    """What a dense hook's `add` gets besides the module: the adapter's scale (a static float, or [] traced where
    scales differ across layers), in training the module's dropout key and rate (key None: no dropout), and the
    base kernel's logical (in, out) axes where known (a hook gathers its leaves by them: `rules.gathered`)."""

    scale: float | jax.Array
    dropout_key: jax.Array | None
    dropout_rate: float
    kernel_axes: tuple[str | None, str | None] | None = None


@dataclass(frozen=True)
class DenseHook:
    """A method's part of `dense` for modules holding leaf `trigger`.

    scale_input(x, module) -> x before the base matmul; add(x, y, module, kernel, branch) -> y after it (`kernel`:
    the whole base weight in x's dtype where `needs_kernel(module)`, else None); scale_output(y, module) -> y after
    the bias. dropout: the hook reads `branch.dropout_key` (no key is drawn for modules without such a hook).
    product(x, kernel, module, branch) -> y: the base matmul with `add`'s branch folded in, one product in place of
    both, which `dense` takes on CPU for a whole float kernel where `fuses(module)`.
    """

    trigger: str
    scale_input: Callable | None = None
    add: Callable | None = None
    scale_output: Callable | None = None
    needs_kernel: Callable[[dict], bool] = lambda module: False
    dropout: bool = False
    product: Callable | None = None
    fuses: Callable[[dict], bool] = lambda module: False


@dataclass(frozen=True)
class AdapterForward:
    """dropout_rate(method): the rate training drops the method's branch inputs at; scales(method, cfg): one static
    scale, or {module: [L] scales} carried in the layers (`linear.with_lora_scales`)."""

    dropout_rate: Callable[[MethodConfig], float] = lambda method: 0.0
    scales: Callable[[MethodConfig, ModelConfig], float | dict] = lambda method, cfg: 1.0


DENSE_HOOKS: dict[str, DenseHook] = {}
ADAPTER_FORWARDS: dict[str, AdapterForward] = {}


def adapter_forward(method: MethodConfig | None) -> AdapterForward:
    """The forward's view of `method` (None: the base model)."""
    if method is None:
        return AdapterForward()
    if method.kind not in ADAPTER_FORWARDS:
        raise JaxtuneError(f"method kind {method.kind!r} has no forward registered (jaxtune.methods.register)")
    return ADAPTER_FORWARDS[method.kind]


def dense_hooks(module: dict) -> list[DenseHook]:
    """The hooks of the leaves `module` holds, in registration order."""
    return [hook for trigger, hook in DENSE_HOOKS.items() if trigger in module]
