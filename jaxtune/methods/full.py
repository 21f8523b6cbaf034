"""Full fine-tuning: every floating-point weight trains; no leaves are added. Exported as a Hugging Face model."""

from __future__ import annotations

from jaxtune.methods.base import Method, PlannerCosts

FULL = Method(
    kind="full",
    trains_base=True,
    costs=PlannerCosts(trains_input=lambda method, module, adapted: True),
)
