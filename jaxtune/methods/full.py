"""Full fine-tuning: every floating-point weight trains; no leaves are added. Exported as a Hugging Face model.
A vision-language model's image side trains where `vision_modules` names its parts (frozen by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxtune.config.method import MethodConfig, vision_module_names
from jaxtune.methods.base import Method, PlannerCosts


@dataclass(frozen=True, kw_only=True)
class FullConfig(MethodConfig):
    """vision_modules: parts of a vision-language model's image side that train too (the family's names,
    transformers' module paths: `vision_tower`, `multi_modal_projector`, `visual`, `visual.merger`); empty: frozen."""

    kind: ClassVar[str] = "full"

    vision_modules: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "vision_modules", vision_module_names(self.vision_modules))


def _lighter(method: FullConfig) -> tuple[tuple[str, MethodConfig], ...]:
    from jaxtune.methods.lora import LoRAConfig, QLoRAConfig  # the lighter methods the planner suggests instead

    return (("LoRA on all linear layers", LoRAConfig(target_modules=("all-linear",))),
            ("QLoRA 4-bit", QLoRAConfig(bits=4)))


FULL = Method(
    kind="full",
    options=FullConfig,
    trains_base=True,
    costs=PlannerCosts(trains_input=lambda method, module, adapted: True, lighter=_lighter),
    label=lambda method: "full fine-tuning",
)
