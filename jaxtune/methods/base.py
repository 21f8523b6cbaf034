"""A fine-tuning method, declared once: what the config, the forward, the trainer, the exporters and the planner know.

Adding a method is one module in this package that builds a `Method`, and its `register` line in `__init__.py`;
nothing else names methods. A kind the registry does not know fails loudly wherever it is used (`method_unit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jax

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.config.method import METHOD_FIELDS, MethodFields
from jaxtune.config.model import SEPARATE_MODULES, SHARED_EXPERT_MODULES
from jaxtune.errors import ConfigError
from jaxtune.models.adapters import ADAPTER_FORWARDS, DENSE_HOOKS, AdapterForward, DenseHook


@dataclass(frozen=True)
class PeftFormat:
    """A method's PEFT adapter format: config(cfg, method) -> its adapter_config.json keys (`peft.peft_config` adds
    the common ones); tensors(params, cfg, method) -> {PEFT name: float32 array in torch's layout}; method_of(config,
    get, targets) -> the MethodConfig a PEFT config describes (get(key, default) reads a key, None as unset;
    targets: its target_modules checked); load(tensors, params, cfg, method) -> params with the adapter's leaves.
    peft_types: the `peft_type` values it reads (none: it writes adapters jaxtune reads as another method's);
    read_fields: the config fields it reads."""

    peft_types: tuple[str, ...]
    read_fields: tuple[str, ...]
    config: Callable
    tensors: Callable
    method_of: Callable | None = None
    load: Callable | None = None


@dataclass(frozen=True)
class PlannerCosts:
    """What the planner counts for a method beyond its trees (which it takes from the spine).

    trains_input(method, module, adapted): the backward keeps `module`'s input (its weights or a branch read it);
    saved(method, adapted, out_width, b, T, D): extra per-layer saved activations [(name, shape, is_float32)];
    low_rank: LoRA-like branches x A B on each adapted module (x A saved, 6 FLOPs a trainable parameter a token, the
    branch's gradient beside the frozen matmul's); attended_tokens(method): key positions added to every row.
    """

    trains_input: Callable[[MethodConfig, str, dict], bool] = lambda method, module, adapted: False
    saved: Callable = lambda method, adapted, out_width, b, T, D: []
    low_rank: bool = False
    attended_tokens: Callable[[MethodConfig], int] = lambda method: 0


@dataclass(frozen=True)
class Method:
    """One fine-tuning method.

    kind            the `[method] kind` value
    fields          what it reads of MethodConfig, its default targets and its value checks
    add_leaves      (params, cfg, method, key) -> the (quantised) base tree with its leaves added
    leaves          names of the leaves it adds: trainable, stripped for a reference "with adapters off"
    module_axes     logical axes of a leaf in a linear module, from the kernel's (layers, in, out)
    leaf_axes       logical axes of other leaves, by dict path
    dense           its parts of `models.linear.dense`; forward: its dropout rate and scales
    adapted         (method, num_layers, modules) -> {module: largest rank (0 without one)} it adapts
    count           (params, method, adapted) -> PEFT's count of its parameters where padding differs, else None
    trains_base     the base weights train (full fine-tuning)
    quantize_base   (params, method) -> the frozen base quantised (QLoRA), None: the base is kept as loaded
    merge           (params, method, dtype) -> a plain model; merged_layer(params, method) -> tensor(path, layer)
    peft            its PEFT format, None without one; gguf_lora: it exports as a GGUF LoRA adapter
    costs           the planner's view; label(method): how reports name it
    """

    kind: str
    fields: MethodFields = field(default_factory=MethodFields)
    add_leaves: Callable[[dict, ModelConfig, MethodConfig, jax.Array], dict] = lambda p, cfg, method, key: p
    leaves: tuple[str, ...] = ()
    module_axes: Mapping[str, Callable] = field(default_factory=dict)
    leaf_axes: Mapping[tuple, tuple] = field(default_factory=dict)
    dense: tuple[DenseHook, ...] = ()
    forward: AdapterForward = field(default_factory=AdapterForward)
    adapted: Callable[[MethodConfig, int, tuple], dict] = lambda method, num_layers, modules: {}
    count: Callable | None = None
    trains_base: bool = False
    quantize_base: Callable[[dict, MethodConfig], dict] | None = None
    merge: Callable | None = None
    merged_layer: Callable | None = None
    peft: PeftFormat | None = None
    gguf_lora: bool = False
    costs: PlannerCosts = field(default_factory=PlannerCosts)
    label: Callable[[MethodConfig], str] = lambda method: method.kind


METHODS: dict[str, Method] = {}


def register(unit: Method) -> Method:
    """Make `unit` known to the config, the forward and everything that reads `METHODS`."""
    METHODS[unit.kind] = unit
    METHOD_FIELDS[unit.kind] = unit.fields
    ADAPTER_FORWARDS[unit.kind] = unit.forward
    for hook in unit.dense:
        DENSE_HOOKS[hook.trigger] = hook
    return unit


def method_unit(method: MethodConfig | str) -> Method:
    """The registered unit of `method` (or of a kind), or a ConfigError listing them."""
    kind = method if isinstance(method, str) else method.kind
    if kind not in METHODS:
        raise ConfigError("kind", kind, "choose one of " + ", ".join(METHODS))
    return METHODS[kind]


def adapter_keys() -> tuple[str, ...]:
    """Every leaf name a registered method adds, and a reward model's `score` head (trained with any method)."""
    return tuple(dict.fromkeys(leaf for unit in METHODS.values() for leaf in unit.leaves)) + ("score",)


def adapted_modules(method: MethodConfig, num_layers: int, modules: tuple[str, ...]) -> dict[str, int]:
    """{module name: its largest rank (0 without one)} of the linear modules `method` adapts in any layer."""
    return method_unit(method).adapted(method, num_layers, modules)


def module_keys(key: jax.Array) -> dict[str, jax.Array]:
    """One key per linear module (the split and fold-ins every method's leaves were first drawn with)."""
    keys = dict(zip(SEPARATE_MODULES + ("prefix", "attn", "mlp"), jax.random.split(key, 10)))
    keys.update({name: jax.random.fold_in(key, i)
                 for i, name in enumerate(("qkv_proj", "gate_up_proj") + SHARED_EXPERT_MODULES)})
    return keys
