"""Full fine-tuning: every floating-point weight trains; no leaves are added. Exported as a Hugging Face model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxtune.config.method import MethodConfig
from jaxtune.methods.base import Method, PlannerCosts


@dataclass(frozen=True, kw_only=True)
class FullConfig(MethodConfig):
    """Full fine-tuning has no options."""

    kind: ClassVar[str] = "full"


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
