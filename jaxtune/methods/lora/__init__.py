"""LoRA (rsLoRA, DoRA, a LoRA bias, expert stacks, inits from the base weights) and QLoRA, LoRA on a frozen NF4 or
int8 base: the two units, and everything they know, a file an idea.
    options.py   LoRAConfig, QLoRAConfig: the `[method]` keys, checked
    layout.py    which modules and layers, with which rank and alpha (PEFT's rules)
    leaves.py    the leaves added to the tree, QLoRA's quantised base, PEFT's parameter counts
    product.py   the forward: the branch (added, or folded into the base GEMM), DoRA, the experts' branch
    init.py      PiSSA, OLoRA, LoftQ: A and B from the base weights, which they change
    merge.py     merge / merged_layer / unmerge
    peft.py      PEFT's adapter format;  gguf.py: llama.cpp's GGUF LoRA;  rows.py: several adapters in one batch
"""

from __future__ import annotations

import dataclasses

from jaxtune.config.method import MethodConfig
from jaxtune.methods.base import AdapterRows, BaseInit, Method, PeftFormat, PlannerCosts
from jaxtune.methods.lora.gguf import save_gguf_lora
from jaxtune.methods.lora.init import CONVERTED_INITS, changed_module_names, initialise, read_layers
from jaxtune.methods.lora.layout import lora_layout
from jaxtune.methods.lora.leaves import LORA_AXES, LORA_LEAVES, add_lora, count, loraplus_rates, quantize_base
from jaxtune.methods.lora.merge import merge, merged_layer, unmerge
from jaxtune.methods.lora.options import LoRAConfig, QLoRAConfig
from jaxtune.methods.lora.peft import (
    PEFT_READ_FIELDS,
    _method_of,
    _peft_config,
    _peft_load,
    _peft_tensors,
    _qlora_peft_config,
    as_stored,
)
from jaxtune.methods.lora.rows import stack_adapters, why_not_mixed
from jaxtune.methods.targets import LINEAR_MODULE_NAMES

__all__ = ["LORA", "QLORA", "LoRAConfig", "QLoRAConfig", "merge", "unmerge"]


def _label(method: LoRAConfig) -> str:
    """"LoRA r=8 on q_proj,v_proj", "QLoRA 4-bit r=16 on all-linear"."""
    targets = method.target_modules if isinstance(method.target_modules, str) else ",".join(method.target_modules)
    targets = "all-linear" if targets == ",".join(LINEAR_MODULE_NAMES) else targets
    name = f"QLoRA {method.bits}-bit" if isinstance(method, QLoRAConfig) else "LoRA"
    return f"{name} r={method.rank}" + (f" on {targets}" if targets else "")


def _lighter(method: LoRAConfig) -> tuple[tuple[str, MethodConfig], ...]:
    """QLoRA 4-bit of the same adapter (from LoRA, or from 8-bit QLoRA)."""
    if isinstance(method, QLoRAConfig):
        return () if method.bits == 4 else (("QLoRA 4-bit", method.replace(bits=4)),)
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}
    return (("QLoRA 4-bit", QLoRAConfig(**fields, bits=4)),)


def _float_base(method: QLoRAConfig) -> LoRAConfig:
    """The same adapter on the float weights (an init that changed the quantised base is gone with it)."""
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(LoRAConfig)}
    return LoRAConfig(**{**fields, "init": "default" if method.init == "loftq" else method.init, "loftq_iter": 1})


def _trains_input(method: LoRAConfig, module: str, adapted: dict) -> bool:
    """The backward keeps the input of an adapted module, and of a mixture's experts ("experts") that
    `target_parameters` adapts."""
    return module in adapted or (module == "experts" and bool(method.target_parameters))


def _needs_initial(method: LoRAConfig) -> bool:
    return method.init in CONVERTED_INITS


def _base(method: QLoRAConfig) -> str:
    return ("NF4" if method.bits == 4 else "INT8") + (", double quantisation" if method.bits == 4 and
                                                       method.double_quant else "")


LORA: Method[LoRAConfig] = Method(
    kind="lora",
    options=LoRAConfig,
    add_leaves=add_lora,
    leaves=LORA_LEAVES,
    module_axes=LORA_AXES,
    adapted=lambda method, stacks: {name: m.max_rank for name, m in lora_layout(method, stacks).items()},
    count=count,
    base_init=BaseInit(changed_module_names, read_layers, initialise),
    merge=merge,
    merged_layer=merged_layer,
    peft=PeftFormat(("LORA",), PEFT_READ_FIELDS, _peft_config, _peft_tensors, _method_of, _peft_load, as_stored,
                    needs_initial=_needs_initial),
    gguf_lora=save_gguf_lora,
    adapter_rows=AdapterRows(why_not_mixed, stack_adapters),
    learning_rates=loraplus_rates,
    costs=PlannerCosts(trains_input=_trains_input, low_rank=True, lighter=_lighter),
    label=_label,
    summary=lambda method: method.kind + (" (DoRA)" if method.dora else ""),
)
QLORA: Method[QLoRAConfig] = Method(
    kind="qlora",
    options=QLoRAConfig,
    add_leaves=add_lora,
    leaves=LORA_LEAVES,
    module_axes=LORA_AXES,
    adapted=LORA.adapted,
    count=count,
    quantize_base=quantize_base,
    frozen_base=_base,
    on_float_base=_float_base,
    base_init=BaseInit(changed_module_names, read_layers, initialise),
    merge=merge,
    merged_layer=merged_layer,
    peft=PeftFormat((), PEFT_READ_FIELDS, _qlora_peft_config, _peft_tensors, _method_of, _peft_load, as_stored,
                    needs_initial=_needs_initial),
    gguf_lora=save_gguf_lora,
    adapter_rows=AdapterRows(why_not_mixed, stack_adapters),
    learning_rates=loraplus_rates,
    costs=PlannerCosts(trains_input=LORA.costs.trains_input, low_rank=True, lighter=_lighter,
                       searched={"bits": (4, 8)}),
    label=_label,
    summary=lambda method: method.kind + (" (DoRA)" if method.dora else ""),
)
