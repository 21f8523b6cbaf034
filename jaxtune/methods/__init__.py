"""The fine-tuning methods, one unit each (`base.py` says what a unit declares), registered here and only here.

Adding a method: a module (or package) beside these that declares its options class and builds a `Method`, and its
entry in the tuple below. `method_config(kind, **options)` makes a unit's options from its kind (what `[method]`
in a run's TOML and `jaxtune plan --method` give).
"""

from __future__ import annotations

import dataclasses

from jaxtune.config.method import MethodConfig
from jaxtune.errors import ConfigError
from jaxtune.methods.adapter import ADAPTER, AdapterConfig
from jaxtune.methods.base import METHODS, Method, method_unit
from jaxtune.methods.full import FULL, FullConfig
from jaxtune.methods.ia3 import IA3, IA3Config
from jaxtune.methods.lora import LORA, QLORA, LoRAConfig, QLoRAConfig
from jaxtune.methods.prefix import PREFIX, PrefixConfig

METHODS.update({unit.kind: unit for unit in (FULL, LORA, QLORA, IA3, PREFIX, ADAPTER)})

__all__ = ["METHODS", "Method", "method_unit", "method_config", "option_names", "AdapterConfig", "FullConfig",
           "IA3Config", "LoRAConfig", "PrefixConfig", "QLoRAConfig"]


def option_names(kind: str) -> tuple[str, ...]:
    """The `[method]` keys a kind reads, besides `kind`."""
    return tuple(f.name for f in dataclasses.fields(method_unit(kind).options))


def method_config(kind: str = "lora", **options) -> MethodConfig:
    """The options of the method `kind`: `method_config("lora", rank=16)` is `LoRAConfig(rank=16)`. An option the
    unit does not read is a ConfigError naming it and the kinds that read it."""
    unit = method_unit(kind)
    known = option_names(kind)
    for name, value in options.items():
        if name not in known:
            readers = [k for k in METHODS if name in option_names(k)]
            raise ConfigError(name, value, f"is for {_kinds(readers)}, not {kind}" if readers else
                              f"is not an option of {kind} (its options: {', '.join(known) or 'none'})")
    return unit.options(**options)


def _kinds(kinds: list[str]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
