"""A fine-tuning method and its hyper-parameters (PEFT's fields where PEFT has them), validated where they are set."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields

from jaxtune.config.model import EXPERT_MODULES, FUSED_MODULES, SEPARATE_MODULES
from jaxtune.errors import ConfigError, check_choice, check_range

# Every family's linear module names (Phi-3's fused ones last: a module's index seeds its LoRA dropout masks).
LINEAR_MODULE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj")
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
            return LINEAR_MODULE_NAMES
        return tuple(n for n in LINEAR_MODULE_NAMES if n in names)
    return tuple(sorted(set(names)))


def _targets(field: str, value):
    """A tuple of names (canonical order), or a str: a regular expression over module paths, as in PEFT."""
    if isinstance(value, str):
        if value in ("all-linear", "all_linear") or value in LINEAR_MODULE_NAMES:
            return _module_names(field, (value,))
        _is_regex(field, value)
        return value
    return _module_names(field, value)


def _pattern(field: str, value, kind) -> tuple:
    """PEFT's rank_pattern / alpha_pattern ({regex: value}) as a hashable tuple of pairs, in the given order."""
    pairs = tuple(value.items()) if isinstance(value, dict) else tuple(tuple(p) for p in value)
    for key, v in pairs:
        _is_regex(field, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) or not v > 0:
            raise ConfigError(f"{field}[{key!r}]", v, f"must be a positive {'integer' if kind is int else 'number'}")
    return tuple((str(k), kind(v)) for k, v in pairs)


@dataclass(frozen=True)
class MethodConfig:
    """A fine-tuning method and its hyper-parameters.

    kind: full | lora | qlora | ia3 | prefix | adapter.
    target_modules: module names (q_proj ... down_proj; Phi-3's fused qkv_proj and gate_up_proj), ("all-linear",)
    (every linear module of the model's layers; a list naming all of one layout's is the same), module paths as PEFT
    writes them (`model.layers.1.mlp.up_proj`), or a string: a regular expression over such paths (PEFT's string
    form); default q_proj v_proj (k_proj v_proj down_proj for IA3, which scales the input of MLP modules and the
    output of attention modules, as PEFT does). exclude_modules, layers_to_transform (+ layers_pattern),
    rank_pattern and alpha_pattern ({regex: rank or alpha}, first match wins) narrow or vary that per module and
    layer with PEFT's rules (see `jaxtune.methods.targets`). LoRA scaling is alpha / rank, or alpha / sqrt(rank) with
    `rslora` (Kalajdzievski 2023); `dora` adds DoRA's magnitude vector (Liu et al. 2024); `lora_bias` gives LoRA's B
    a bias. modules_to_save: lm_head and/or embed_tokens, trained whole beside the adapter (PEFT's field of that
    name). target_parameters (PEFT's field): a mixture's expert stacks, `mlp.experts.gate_up_proj` and/or
    `mlp.experts.down_proj`, each expert with its own A and B (without dropout, DoRA, a LoRA bias or per-layer
    rules, as PEFT's); target_modules may then be empty. init (PEFT's `init_lora_weights`): "default" (A
    kaiming-uniform, B zero), "gaussian" (A ~ N(0, 1/r)), or from the base weights, which it changes: "pissa" (top
    singular vectors), "olora" (QR), or on a quantised base "loftq" (`loftq_iter` alternations), as
    `jaxtune.methods.lora_init` says. QLoRA keeps every linear base weight (a mixture's experts
    too) frozen in `bits` (4: NF4, 8: int8), with `double_quant` compressing the NF4 block scales. Prefix tuning
    learns `num_virtual_tokens` keys and values per layer; bottleneck adapters of width `adapter_size` follow
    attention and MLP (Houlsby et al. 2019).
    loraplus_lr_ratio (PEFT's `create_loraplus_optimizer`; LoRA+, Hayou et al. 2024): the LoRA B matrices (and
    vectors: a LoRA bias, DoRA's magnitude) learn at learning_rate x this ratio (0: off; `spine.optimizers`).

    An invalid value raises a `ConfigError` (a ValueError) naming the field, the value and what is valid.
    """

    kind: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ()
    rslora: bool = False
    dora: bool = False
    bits: int = 4
    double_quant: bool = True
    num_virtual_tokens: int = 16
    adapter_size: int = 64
    exclude_modules: tuple[str, ...] | str = ()
    layers_to_transform: tuple[int, ...] = ()
    layers_pattern: tuple[str, ...] = ()
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    lora_bias: bool = False
    modules_to_save: tuple[str, ...] = ()
    target_parameters: tuple[str, ...] = ()
    loraplus_lr_ratio: float = 0.0
    init: str = "default"
    loftq_iter: int = 1

    def __post_init__(self):
        check_choice("kind", self.kind, tuple(METHOD_FIELDS))
        unit = METHOD_FIELDS[self.kind]
        set_ = lambda name, value: object.__setattr__(self, name, value)
        experts = (self.target_parameters,) if isinstance(self.target_parameters, str) else self.target_parameters
        set_("target_parameters", tuple(experts))
        default = () if self.target_parameters else unit.default_targets
        set_("target_modules", _targets("target_modules", self.target_modules or default))
        set_("exclude_modules", _targets("exclude_modules", self.exclude_modules) if self.exclude_modules else ())
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
        set_("rank_pattern", _pattern("rank_pattern", self.rank_pattern, int))
        set_("alpha_pattern", _pattern("alpha_pattern", self.alpha_pattern, float))
        saved = (self.modules_to_save,) if isinstance(self.modules_to_save, str) else tuple(self.modules_to_save)
        for module in saved:
            if module not in SAVABLE_MODULES:
                raise ConfigError("modules_to_save", module, f"jaxtune trains whole {' and '.join(SAVABLE_MODULES)}")
        set_("modules_to_save", tuple(m for m in SAVABLE_MODULES if m in saved))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ConfigError("rank", self.rank, "LoRA's rank is a positive integer")
        check_range("dropout", self.dropout, 0.0, 1.0, high_open=True)
        check_range("loraplus_lr_ratio", self.loraplus_lr_ratio, 0.0)
        for name in CLAIMED_FIELDS:
            if getattr(self, name) != _DEFAULTS[name] and name not in unit.fields:
                readers = [kind for kind, fields in METHOD_FIELDS.items() if name in fields.fields]
                raise ConfigError(name, getattr(self, name), f"is for {_kinds(readers)}, not {self.kind}")
        unit.check(self)

    @property
    def expert_modules(self) -> tuple[str, ...]:
        """The expert stacks `target_parameters` adapts, in the tree's order (gate_up_proj, down_proj)."""
        named = {p.rsplit(".", 1)[-1] for p in self.target_parameters}
        return tuple(m for m in EXPERT_MODULES if m in named)

    @property
    def lora_scale(self) -> float:
        """alpha / rank (rsLoRA: alpha / sqrt(rank)); per-module or per-layer patterns: see `methods.targets`."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


# Fields a method must read to be given: set on a method that does not read one, they are an error naming who does.
CLAIMED_FIELDS = ("dropout", "rslora", "dora", "lora_bias", "rank_pattern", "alpha_pattern", "exclude_modules",
                  "layers_to_transform", "modules_to_save", "target_parameters", "init", "loftq_iter",
                  "loraplus_lr_ratio")
_DEFAULTS = {f.name: f.default for f in fields(MethodConfig)}


@dataclass(frozen=True)
class MethodFields:
    """What a registered method reads of `MethodConfig` (`jaxtune.methods.base.Method.fields`).

    fields: the CLAIMED_FIELDS it reads; default_targets: target_modules when none are given; check(method): its own
    value checks, raising `ConfigError`.
    """

    fields: tuple[str, ...] = ()
    default_targets: tuple[str, ...] = ()
    check: Callable[[MethodConfig], None] = lambda method: None


METHOD_FIELDS: dict[str, MethodFields] = {}  # kind -> what it reads; filled by `jaxtune.methods.register`


def _kinds(kinds: list[str]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
