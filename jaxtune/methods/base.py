"""A fine-tuning method, declared once (`Method`): what the config, the forward, the loader, the trainer, the
exporters and the planner know of it.

Adding a method is one module (or package) in `jaxtune/methods/` that declares its options class (a `MethodConfig`)
and builds a `Method`, and its entry in `methods/__init__.py`'s registry; nothing else names methods. A `Method` is
generic in its options type, so a unit's functions are checked against the options they read. A kind the registry
does not know fails loudly wherever it is used (`method_unit`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from jaxtune.config.method import MethodConfig
from jaxtune.config.model import (
    FUSED_LINEAR_ATTENTION_MODULES,
    GLOBAL,
    LATENT_ATTENTION_MODULES,
    LINEAR_ATTENTION_MODULES,
    SEPARATE_MODULES,
    SHARED_EXPERT_MODULES,
    WIDE,
    ModelConfig,
)
from jaxtune.errors import ConfigError

Options = TypeVar("Options", bound=MethodConfig)


@dataclass(frozen=True)
class PeftFormat(Generic[Options]):
    """A method's PEFT adapter format.

    config(cfg, method) -> its adapter_config.json keys (`peft.peft_config` adds the common ones); tensors(params,
    cfg, method) -> {PEFT name: float32 array in torch's layout}; method_of(config, get, targets) -> the options a
    PEFT config describes (get(key, default) reads a key, None as unset; targets: its target_modules checked);
    load(tensors, params, cfg, method) -> params with the adapter's leaves. peft_types: the `peft_type` values it
    reads (none: it writes adapters jaxtune reads as another method's); read_fields: the config fields it reads.
    as_stored(params, method, initial, cfg) -> (params, method) as PEFT stores them, where the method's init
    changed the base (`BaseInit`: PiSSA and OLoRA convert to a LoRA on the original weights from the init's leaves
    `initial`); needs_initial(method): whether it needs them.
    """

    peft_types: tuple[str, ...]
    read_fields: tuple[str, ...]
    config: Callable[[ModelConfig, Options], dict]
    tensors: Callable[[dict, ModelConfig, Options], dict[str, np.ndarray]]
    method_of: Callable[[dict, Callable[[str, Any], Any], Any], MethodConfig] | None = None
    load: Callable[[dict, dict, ModelConfig, Options], dict] | None = None
    as_stored: Callable[[dict, Options, dict | None, ModelConfig], tuple[dict, Options]] | None = None
    needs_initial: Callable[[Options], bool] = lambda method: False


@dataclass(frozen=True)
class BaseInit(Generic[Options]):
    """A method whose initial leaves come from the base weights, which it changes (LoRA's PiSSA, OLoRA, LoftQ).

    modules(method, cfg) -> the linear modules whose kernels it changes (none: the base stays as read).
    layers(method, cfg, name, read_layer) -> for each layer i of module `name`, (its new base kernel [in, out],
    in the dtype of read_layer(i)'s [in, out] host array or quantised as the method holds its base; {leaf: its
    value for layer i, float32}), one layer at a time, so the loader never holds more than a layer beside what it
    places (`spine/load.py`).
    tree(params, cfg, method) -> (params with each changed kernel, {module: {leaf: [L, ...]}}): the same on a float
    base tree in memory, traceable (`transform.apply_method`).
    """

    modules: Callable[[Options, ModelConfig], tuple[str, ...]]
    layers: Callable[[Options, ModelConfig, str, Callable[[int], np.ndarray]], Iterator[tuple[Any, dict]]]
    tree: Callable[[dict, ModelConfig, Options], tuple[dict, dict]]


@dataclass(frozen=True)
class AdapterRows(Generic[Options]):
    """Several adapters of a method in one batch, each row its own (LoRA's sums: `models/adapter_rows.py` runs them).

    why_not(method) -> what keeps an adapter of these options out of such a batch (DoRA, ...), or None.
    stack({name: (method, params)}, cfg) -> the shared base tree with the adapters stacked, adapter i in slot i + 1.
    """

    why_not: Callable[[Options], str | None]
    stack: Callable[[dict, ModelConfig], dict]


@dataclass(frozen=True)
class PlannerCosts(Generic[Options]):
    """What the planner counts for a method beyond its trees (which it takes from the spine), and the choices it
    suggests.

    trains_input(method, module, adapted): the backward keeps `module`'s input (its weights or a branch read it);
    saved(method, adapted, out_width, b, T, D): extra per-layer saved activations [(name, shape, is_float32)];
    low_rank: LoRA-like branches x A B on each adapted module (x A saved, 6 FLOPs a trainable parameter a token, the
    branch's gradient beside the frozen matmul's); attended_tokens(method): key positions added to every row.
    lighter(method) -> ((what to say, options), ...): methods that hold less, for the search to suggest in order.
    searched: {option: values} the search tries (QLoRA's bits), unless the user fixed that option.
    """

    trains_input: Callable[[Options, str, dict], bool] = lambda method, module, adapted: False
    saved: Callable[[Options, dict, dict, int, int, int], list] = lambda method, adapted, out_width, b, T, D: []
    low_rank: bool = False
    attended_tokens: Callable[[Options], int] = lambda method: 0
    lighter: Callable[[Options], tuple[tuple[str, MethodConfig], ...]] = lambda method: ()
    searched: Mapping[str, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class Method(Generic[Options]):
    """One fine-tuning method.

    kind            the `[method] kind` value (the options class's `kind`)
    options         its options class: the `[method]` keys it reads, checked where they are set
    add_leaves      (params, cfg, method, key) -> the (quantised) base tree with its leaves added
    leaves          names of the leaves it adds: trainable, stripped for a reference "with adapters off"
    module_axes     logical axes of a leaf in a linear module, from the kernel's (layers, in, out)
    leaf_axes       logical axes of other leaves, by dict path
    adapted         (method, stacks) -> {module: largest rank (0 without one)} it adapts among `stacks`
                    ((module, the layers holding it): `ModelConfig.layer_stacks`)
    count           (params, method, stacks) -> PEFT's count of its parameters where padding differs, else None
    trains_base     the base weights train (full fine-tuning)
    quantize_base   (params, method) -> the frozen base quantised (QLoRA), None: the base is kept as loaded
    base_init       its init from the base weights, which it changes (`BaseInit`), or None
    merge           (params, method, dtype, cfg) -> a plain model; merged_layer(params, method, cfg) -> tensor(path,
                    row): row `row` of a stacked leaf (cfg: whose layers hold each module; None: every layer)
    peft            its PEFT format, None without one
    frozen_base     (method) -> how it holds the frozen base when not as stored ("NF4, double quantisation"), or None
    on_float_base   (method) -> the same adapter on the float weights (QLoRA's as LoRA), None: it runs on them
    gguf_lora       (path, cfg, params, method, name) -> path: writes it as llama.cpp's GGUF LoRA; None: it cannot
    adapter_rows    how adapters of it share a batch, each row its own (`AdapterRows`); None: they cannot
    learning_rates  (method, trainable) -> a tree like `trainable` of learning-rate multiples (LoRA+), None: all 1
    costs           the planner's view; label(method): how the planner's reports name it; summary(method): how
                    `jaxtune info` names an adapter of it
    """

    kind: str
    options: type[Options]
    add_leaves: Callable[[dict, ModelConfig, Options, jax.Array], dict] = lambda params, cfg, method, key: params
    leaves: tuple[str, ...] = ()
    module_axes: Mapping[str, Callable] = field(default_factory=dict)
    leaf_axes: Mapping[tuple, tuple] = field(default_factory=dict)
    adapted: Callable[[Options, tuple], dict[str, int]] = lambda method, stacks: {}
    count: Callable[[dict, Options, tuple], dict[str, int]] | None = None
    trains_base: bool = False
    quantize_base: Callable[[dict, Options], dict] | None = None
    base_init: BaseInit[Options] | None = None
    merge: Callable[..., dict] | None = None
    merged_layer: Callable[[dict, Options, ModelConfig | None], Callable] | None = None
    peft: PeftFormat[Options] | None = None
    frozen_base: Callable[[Options], str | None] = lambda method: None
    on_float_base: Callable[[Options], MethodConfig] | None = None
    gguf_lora: Callable[..., Any] | None = None
    adapter_rows: AdapterRows[Options] | None = None
    learning_rates: Callable[[Options, dict], dict | None] = lambda method, trainable: None
    costs: PlannerCosts[Options] = field(default_factory=PlannerCosts)
    label: Callable[[Options], str] = lambda method: method.kind
    summary: Callable[[Options], str] = lambda method: method.kind

    def __post_init__(self):
        if self.options.kind != self.kind:
            raise ValueError(f"method {self.kind!r}: its options class {self.options.__name__} says kind "
                             f"{self.options.kind!r}")


METHODS: dict[str, Method] = {}  # kind -> unit, filled in one place: `jaxtune/methods/__init__.py`


def method_unit(method: MethodConfig | str) -> Method:
    """The registered unit of `method` (or of a kind), or a ConfigError listing them."""
    kind = method if isinstance(method, str) else method.kind
    if kind not in METHODS:
        raise ConfigError("kind", kind, "choose one of " + ", ".join(METHODS))
    return METHODS[kind]


def adapter_keys() -> tuple[str, ...]:
    """Every leaf name a registered method adds."""
    return tuple(dict.fromkeys(leaf for unit in METHODS.values() for leaf in unit.leaves))


def adapted_modules(method: MethodConfig, stacks: tuple) -> dict[str, int]:
    """{module name: its largest rank (0 without one)} of the linear modules `method` adapts in any layer."""
    return method_unit(method).adapted(method, stacks)


def module_keys(key: jax.Array) -> dict[str, jax.Array]:
    """One key per linear module (the split and fold-ins every method's leaves were first drawn with)."""
    keys = dict(zip(SEPARATE_MODULES + ("prefix", "attn", "mlp"), jax.random.split(key, 10)))
    keys.update({name: jax.random.fold_in(key, i)
                 for i, name in enumerate(("qkv_proj", "gate_up_proj") + SHARED_EXPERT_MODULES
                                          + LINEAR_ATTENTION_MODULES + FUSED_LINEAR_ATTENTION_MODULES[:2]
                                          + LATENT_ATTENTION_MODULES[:4])})
    keys.update({name + suffix: jax.random.fold_in(keys[name], i + 1)  # Gemma 4's stacks of other shapes
                 for i, suffix in enumerate((GLOBAL, WIDE)) for name in SEPARATE_MODULES})
    return keys
