"""What every fine-tuning method's options are, and what a method hands the forward pass.

Each method unit (`jaxtune.methods`) declares its own options class beside its code (`LoRAConfig`, `IA3Config`,
`PrefixConfig`, ...): a frozen, keyword-only dataclass deriving from `MethodConfig`, with the fields it reads (PEFT's
names where PEFT has them) checked where they are set; `kind` (a class attribute) names the unit. `[method]` in a
run's TOML holds the kind and that unit's keys (`jaxtune.methods.method_config`).

The forward (`jaxtune.models`) names no method: it asks the options for an `AdapterForward` (`forward_of`), the
hooks that run the method's leaves where a module holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Self

from jaxtune.errors import ConfigError

if TYPE_CHECKING:
    import jax

    from jaxtune.config.model import ModelConfig


class Branch(NamedTuple):
    """What a dense hook gets besides the module: in training the module's dropout key and rate (key None: no
    dropout), and the base kernel's logical (in, out) axes where known (a hook gathers its leaves by them)."""

    dropout_key: jax.Array | None
    dropout_rate: float
    kernel_axes: tuple[str | None, str | None] | None = None


@dataclass(frozen=True)
class DenseHook:
    """A method's part of `models.linear.dense`, for modules holding leaf `trigger`.

    scale_input(x, module) -> x before the base matmul; add(x, y, module, kernel, branch) -> y after it (`kernel`:
    the whole base weight in x's dtype where `needs_kernel(module)`, else None); scale_output(y, module) -> y after
    the bias. dropout: the hook reads `branch.dropout_key` (no key is drawn for modules without such a hook).
    product(x, kernel, module, branch) -> y: the base matmul with `add`'s branch folded in, one product in place of
    both, which `dense` takes where `linear.folds_branch` says (a whole float kernel on CPU, `fuses(module)`).
    Every function reads `module` as stored, leaves of one layer (a [] scale the method put there included).
    """

    trigger: str
    scale_input: Callable | None = None
    add: Callable | None = None
    scale_output: Callable | None = None
    needs_kernel: Callable[[Mapping], bool] = lambda module: False
    dropout: bool = False
    product: Callable | None = None
    fuses: Callable[[Mapping], bool] = lambda module: False


@dataclass(frozen=True)
class ExpertHook:
    """A method's part of a mixture's grouped products (`models.moe`), for expert stacks holding leaf `trigger`.

    add(x_MxI, y_MxO, module, product) -> y: the rows' products with their experts' kernels `y` plus the method's
    branch, where product(x, w) is the grouped product over the same experts (`moe.grouped_kernel`'s) and
    `module` one layer's stack leaves [E, ...]. leaf_dims: every leaf it reads; for a leaf [E, a, b], which of the
    kernel's dimensions ("in", "out" or None) a and b follow: a leaf is split over devices as its kernel is (a leaf
    without an expert dimension, a scale, is replicated). A kernel that runs per device (megablox) sees only these.
    """

    trigger: str
    add: Callable
    leaf_dims: Mapping[str, tuple[str | None, str | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterForward:
    """What the forward runs of a method: `dense` hooks (each where a module holds its trigger leaf), the expert-
    stack hook, the rate training drops the hooks' inputs at, and prepare(layers) -> the stacked layers with what
    the hooks read beside the weights (LoRA's per-layer scales), applied before the layer scan slices them."""

    dense: tuple[DenseHook, ...] = ()
    experts: ExpertHook | None = None
    dropout_rate: float = 0.0
    prepare: Callable[[dict], dict] | None = None


def vision_module_names(value) -> tuple[str, ...]:
    """`[method] vision_modules` as a tuple of distinct names (a string: one name); its family checks them
    (`methods.vision.trained_parts`)."""
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ConfigError("vision_modules", name, "names a part of the image side, e.g. vision_tower, "
                              "multi_modal_projector (Gemma 3), visual, visual.merger (Qwen2.5-VL)")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """A fine-tuning method's options (a unit's subclass; this base holds none). Hashable: static under jit."""

    kind: ClassVar[str] = ""

    @property
    def trained_whole(self) -> tuple[str, ...]:
        """Modules trained whole beside the method's own leaves (PEFT's `modules_to_save`): none unless the unit's
        options say."""
        return ()

    def forward_of(self, cfg: ModelConfig) -> AdapterForward:
        """What the forward runs of this method on a model of `cfg`: nothing, unless the unit's options say."""
        return AdapterForward()

    def replace(self, **changes) -> Self:
        return dataclasses.replace(self, **changes)
