"""Which modules of which layers a method adapts, with which rank and alpha: PEFT's matching rules on our modules
(`is_target`, `lora_layout -> {module: ModuleLoRA}`, `ia3_modules`).

PEFT decides per module path of the transformers model (`model.layers.{i}.self_attn.q_proj`), in this order
(`check_target_module_exists`, `get_pattern_key`): exclude_modules, then target_modules (a regex, full match, or
names: the path or a suffix after a dot), layers_to_transform (names only: the layer index after `layers_pattern`),
then rank_pattern and alpha_pattern (the first key whose regex `(.*\\.)?key$` matches the path). A module's
`lora_a` [L, in, R] and `lora_b` [L, R, out] have its largest rank R: a layer of rank r < R holds zeros beyond r
(with zero gradients they stay zero under AdamW), and a layer the adapter skips has rank 0 and scale 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from jaxtune.config.method import MethodConfig
from jaxtune.config.model import (
    ATTENTION_MODULES,
    FUSED_MODULES,
    LINEAR_MODULE_NAMES,
    SEPARATE_MODULES,
    hf_module_name,
)
from jaxtune.errors import ConfigError

Stacks: TypeAlias = tuple[tuple[str, tuple[int, ...]], ...]  # (module, the layers holding it), in order
SAVABLE_MODULES = ("lm_head", "embed_tokens")  # what `modules_to_save` may name: trained whole, beside the adapter


def _is_regex(field: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(field, pattern, f"not a regular expression ({e})") from None


def _module_names(field: str, names) -> tuple[str, ...]:
    """PEFT's list form of target_modules / exclude_modules: module names or dotted paths ending in one."""
    names = tuple(names)
    if names in (("all-linear",), ("all_linear",)):
        return LINEAR_MODULE_NAMES
    for name in names:
        if not isinstance(name, str) or name.rsplit(".", 1)[-1] not in LINEAR_MODULE_NAMES:
            hint = " (train it whole with modules_to_save)" if str(name).rsplit(".", 1)[-1] in SAVABLE_MODULES else ""
            raise ConfigError(field, name, f"not a linear module of a decoder layer{hint}; valid names: "
                              f"{', '.join(LINEAR_MODULE_NAMES)}, all-linear, or paths such as "
                              "model.layers.0.self_attn.q_proj")
    if all(n in LINEAR_MODULE_NAMES for n in names):
        if set(names) >= set(SEPARATE_MODULES) or set(names) >= set(FUSED_MODULES):  # every one of a layout's
            names += SEPARATE_MODULES + FUSED_MODULES
        return tuple(n for n in LINEAR_MODULE_NAMES if n in names)
    return tuple(sorted(set(names)))


def module_selection(field: str, value) -> tuple[str, ...] | str:
    """A tuple of names (canonical order), or a str: a regular expression over module paths, as in PEFT."""
    if isinstance(value, str):
        if value in ("all-linear", "all_linear") or value in LINEAR_MODULE_NAMES:
            return _module_names(field, (value,))
        _is_regex(field, value)
        return value
    return _module_names(field, value)


def regex_table(field: str, value, kind) -> tuple:
    """PEFT's rank_pattern / alpha_pattern ({regex: value}) as a hashable tuple of pairs, in the given order."""
    pairs = tuple(value.items()) if isinstance(value, dict) else tuple(tuple(p) for p in value)
    for key, v in pairs:
        _is_regex(field, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) or not v > 0:
            raise ConfigError(f"{field}[{key!r}]", v, f"must be a positive {'integer' if kind is int else 'number'}")
    return tuple((str(k), kind(v)) for k, v in pairs)


@dataclass(frozen=True, kw_only=True)
class Targeted(MethodConfig):
    """The options of a method that adapts chosen linear modules (LoRA, IA3), with PEFT's matching rules.

    target_modules: module names (q_proj ... down_proj; Phi-3's fused qkv_proj and gate_up_proj), ("all-linear",)
    (every linear module of the model's layers; a list naming all of one layout's is the same), module paths as PEFT
    writes them (`model.layers.1.mlp.up_proj`), or a string: a regular expression over such paths (PEFT's string
    form); empty: the unit's `default_targets`. exclude_modules, layers_to_transform (+ layers_pattern) narrow that
    per module and layer (`is_target`). modules_to_save: lm_head and/or embed_tokens, trained whole beside the
    adapter (PEFT's field of that name).
    """

    default_targets: ClassVar[tuple[str, ...]] = ()

    target_modules: tuple[str, ...] | str = ()
    exclude_modules: tuple[str, ...] | str = ()
    layers_to_transform: tuple[int, ...] = ()
    layers_pattern: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("target_modules", module_selection("target_modules", self.target_modules or self._default_targets()))
        set_("exclude_modules", module_selection("exclude_modules", self.exclude_modules)
             if self.exclude_modules else ())
        layers = (self.layers_to_transform,) if isinstance(self.layers_to_transform, int) else self.layers_to_transform
        set_("layers_to_transform", tuple(sorted(set(layers))))
        for layer in self.layers_to_transform:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ConfigError("layers_to_transform", layer, "layer indices are integers >= 0")
        if self.layers_to_transform and isinstance(self.target_modules, str):
            raise ConfigError("layers_to_transform", self.layers_to_transform, "cannot be used with a regular "
                              "expression as target_modules (nor can it in PEFT): put the layers in the expression")
        pattern = (self.layers_pattern,) if isinstance(self.layers_pattern, str) else tuple(self.layers_pattern)
        set_("layers_pattern", tuple(p for p in pattern if p))
        for p in self.layers_pattern:
            _is_regex("layers_pattern", p)
        saved = (self.modules_to_save,) if isinstance(self.modules_to_save, str) else tuple(self.modules_to_save)
        for module in saved:
            if module not in SAVABLE_MODULES:
                raise ConfigError("modules_to_save", module, f"jaxtune trains whole {' and '.join(SAVABLE_MODULES)}")
        set_("modules_to_save", tuple(m for m in SAVABLE_MODULES if m in saved))

    def _default_targets(self) -> tuple[str, ...]:
        """target_modules when none are given."""
        return self.default_targets

    @property
    def trained_whole(self) -> tuple[str, ...]:
        return self.modules_to_save

FUSED_HINT = " (Phi-3 fuses q, k and v into qkv_proj, gate and up into gate_up_proj: target those)"


def uniform_stacks(num_layers: int, modules: tuple[str, ...] = SEPARATE_MODULES) -> Stacks:
    """`modules`, each held by every one of `num_layers` layers (a model without linear-attention layers)."""
    return tuple((name, tuple(range(num_layers))) for name in modules)


def module_path(name: str, layer: int) -> str:
    """The transformers path of linear module `name` of `layer`, e.g. 'model.layers.3.self_attn.q_proj'."""
    name = hf_module_name(name)  # Gemma 4's stacks of other shapes: the module they are
    if name.startswith("linear_attn."):
        return f"model.layers.{layer}.{name}"
    return f"model.layers.{layer}.{'self_attn' if name in ATTENTION_MODULES else 'mlp'}.{name}"


def peft_module(name: str, layer: int) -> str:
    """The PEFT state-dict prefix of linear module `name` of `layer`: 'base_model.model.model.layers.3.mlp.up_proj'."""
    return f"base_model.model.{module_path(name, layer)}"


def peft_names(value):
    """A target/exclude field as PEFT's adapter_config.json writes it: a regex string, a list of names, or None."""
    return value if isinstance(value, str) else (list(value) or None)


def _names_match(names: tuple[str, ...], path: str) -> bool:
    return path in names or any(path.endswith("." + name) for name in names)


def _layer_of(path: str, layers_pattern: tuple[str, ...]) -> int | None:
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        match = next((m for p in layers_pattern if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", path))), None)
    return int(match.group("idx")) if match else None


def is_target(method: Targeted, path: str) -> bool:
    """Whether PEFT adapts the module at `path` under `method`'s target, exclude and layer fields."""
    exclude = method.exclude_modules
    if exclude and (re.fullmatch(exclude, path) if isinstance(exclude, str) else _names_match(exclude, path)):
        return False
    targets = method.target_modules
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    if not _names_match(targets, path):
        return False
    if method.layers_to_transform:
        return _layer_of(path, method.layers_pattern) in method.layers_to_transform
    return True
