"""LoRA's and QLoRA's options (`[method] kind = "lora"` / `"qlora"`), PEFT's `LoraConfig` fields where PEFT has
them, checked where they are set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxtune.config.method import AdapterForward, vision_module_names
from jaxtune.config.model import EXPERT_MODULES, ModelConfig
from jaxtune.errors import ConfigError, check_choice, check_range
from jaxtune.methods.lora.init import BASE_INITS, INITS
from jaxtune.methods.lora.layout import pattern_value
from jaxtune.methods.lora.product import lora_forward
from jaxtune.methods.targets import Targeted, regex_table


@dataclass(frozen=True, kw_only=True)
class LoRAConfig(Targeted):
    """LoRA (Hu et al. 2021) on the linear modules `Targeted` selects (default q_proj, v_proj).

    rank, alpha: the scale is alpha / rank, or alpha / sqrt(rank) with `rslora` (Kalajdzievski 2023); rank_pattern
    and alpha_pattern ({regex: rank or alpha}, first match wins) vary them per module and layer with PEFT's rules
    (`lora.layout`). dropout: on the branch's input in training. `dora` adds DoRA's magnitude vector (Liu et al.
    2024); `lora_bias` gives LoRA's B a bias. target_parameters (PEFT's field): a mixture's expert stacks,
    `mlp.experts.gate_up_proj` and/or `mlp.experts.down_proj`, each expert with its own A and B (without dropout,
    DoRA, a LoRA bias or layers_to_transform, as PEFT's), a stack's rank and alpha its patterns' (one in every
    layer: PEFT fuses a Qwen-MoE adapter's gate_proj and up_proj targets as gate_up_proj at twice both);
    target_modules may then be empty. init (PEFT's
    `init_lora_weights`): "default" (A kaiming-uniform, B zero), "gaussian" (A ~ N(0, 1/r)), or from the base
    weights, which it changes: "pissa" (top singular vectors), "olora" (QR), or on a quantised base "loftq"
    (`loftq_iter` alternations), as `lora.init` says. loraplus_lr_ratio (PEFT's `create_loraplus_optimizer`;
    LoRA+, Hayou et al. 2024): the B matrices (and vectors: a LoRA bias, DoRA's magnitude) learn at learning_rate x
    this ratio (0: off). vision_modules: parts of a vision-language model's image side that train too (the family's
    names, transformers' module paths: `vision_tower`, `visual`: LoRA on their linear modules; a projector,
    `multi_modal_projector`, `visual.merger`: trained whole, PEFT's `modules_to_save`); empty: frozen.
    """

    kind: ClassVar[str] = "lora"
    default_targets: ClassVar[tuple[str, ...]] = ("q_proj", "v_proj")
    quantized: ClassVar[bool] = False  # the frozen base is quantised (QLoRA)

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False
    dora: bool = False
    lora_bias: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    target_parameters: tuple[str, ...] = ()
    loraplus_lr_ratio: float = 0.0
    init: str = "default"
    loftq_iter: int = 1
    vision_modules: tuple[str, ...] = ()

    def __post_init__(self):
        experts = (self.target_parameters,) if isinstance(self.target_parameters, str) else self.target_parameters
        object.__setattr__(self, "target_parameters", tuple(experts))
        super().__post_init__()
        object.__setattr__(self, "rank_pattern", regex_table("rank_pattern", self.rank_pattern, int))
        object.__setattr__(self, "alpha_pattern", regex_table("alpha_pattern", self.alpha_pattern, float))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError("rank", self.rank, "LoRA's rank is a positive integer")
        check_range("alpha", self.alpha, 0, low_open=True)
        check_range("dropout", self.dropout, 0.0, 1.0, high_open=True)
        check_range("loraplus_lr_ratio", self.loraplus_lr_ratio, 0.0)
        self._check_experts()
        if self.dora and self.lora_bias:
            raise ConfigError("lora_bias", True, "DoRA has no LoRA bias (PEFT refuses use_dora with lora_bias too)")
        check_choice("init", self.init, INITS)
        if self.init in BASE_INITS and (self.dora or self.target_parameters):
            raise ConfigError("init", self.init, "initialises plain LoRA on linear modules: not with dora nor "
                              "target_parameters (expert stacks)")
        if self.init == "loftq" and not self.quantized:
            raise ConfigError("init", self.init, "LoftQ initialises LoRA for a quantised base: use kind = qlora")
        if isinstance(self.loftq_iter, bool) or not isinstance(self.loftq_iter, int) or self.loftq_iter < 1:
            raise ConfigError("loftq_iter", self.loftq_iter, "LoftQ's iterations are an integer >= 1")
        if self.loftq_iter != 1 and self.init != "loftq":
            raise ConfigError("loftq_iter", self.loftq_iter, "is for init = loftq")
        object.__setattr__(self, "vision_modules", vision_module_names(self.vision_modules))
        unsupported = {"dropout": self.dropout, "dora": self.dora, "lora_bias": self.lora_bias,
                       "layers_to_transform": self.layers_to_transform, "init": self.init != "default" and self.init}
        for name, value in unsupported.items():  # the tower's LoRA: plain, every layer (PEFT's target one regex)
            if value and self.vision_modules:
                raise ConfigError(name, value, "does not go with vision_modules (the image side's LoRA is plain "
                                  "LoRA, default init, on every layer, without dropout)")

    def _check_experts(self) -> None:
        """Expert stacks alone, as PEFT's parameter LoRA takes them."""
        for name in self.target_parameters:
            parts = str(name).split(".")
            if parts[-1] not in EXPERT_MODULES or (len(parts) > 1 and parts[-2] != "experts"):
                raise ConfigError("target_parameters", name, "jaxtune adapts a mixture's expert stacks: "
                                  "mlp.experts.gate_up_proj and mlp.experts.down_proj")
        if not self.target_parameters:
            return
        unsupported = {"dropout": self.dropout, "dora": self.dora, "lora_bias": self.lora_bias,
                       "layers_to_transform": self.layers_to_transform}
        for name, value in unsupported.items():
            if value:
                raise ConfigError(name, value, "does not go with target_parameters (PEFT's LoRA of a parameter has "
                                  "no dropout, DoRA or LoRA bias; jaxtune gives experts one rank and alpha in every "
                                  "layer)")

    def _default_targets(self) -> tuple[str, ...]:
        return () if self.target_parameters else self.default_targets

    @property
    def expert_modules(self) -> tuple[str, ...]:
        """The expert stacks `target_parameters` adapts, in the tree's order (gate_up_proj, down_proj)."""
        named = {p.rsplit(".", 1)[-1] for p in self.target_parameters}
        return tuple(m for m in EXPERT_MODULES if m in named)

    def expert_lora(self, name: str, layers: tuple[int, ...]) -> tuple[int, float]:
        """(rank, scale) of expert stack `name` (gate_up_proj or down_proj) over the mixture's `layers`:
        rank_pattern and alpha_pattern on its PEFT path `model.layers.{i}.mlp.experts.{name}`, which must give each
        the same."""
        values = {(int(pattern_value(self.rank_pattern, path, self.rank)),
                   float(pattern_value(self.alpha_pattern, path, self.alpha)))
                  for path in (f"model.layers.{i}.mlp.experts.{name}" for i in layers)}
        if len(values) > 1:
            raise ConfigError("rank_pattern", dict(self.rank_pattern), f"gives mlp.experts.{name} different ranks "
                              "or alphas in different layers (jaxtune gives experts one rank and alpha in every layer)")
        rank, alpha = values.pop()
        return rank, alpha / (rank**0.5 if self.rslora else rank)

    @property
    def lora_scale(self) -> float:
        """alpha / rank (rsLoRA: alpha / sqrt(rank)); per-module or per-layer patterns: see `lora.layout`."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def forward_of(self, cfg: ModelConfig) -> AdapterForward:
        return lora_forward(self, cfg)


@dataclass(frozen=True, kw_only=True)
class QLoRAConfig(LoRAConfig):
    """QLoRA (Dettmers et al. 2023): LoRA on a frozen base whose every linear weight (a mixture's experts too) is
    held in `bits` (4: NF4, 8: int8), `double_quant` compressing the NF4 block scales."""

    kind: ClassVar[str] = "qlora"
    quantized: ClassVar[bool] = True

    bits: int = 4
    double_quant: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_choice("bits", self.bits, (4, 8))
