"""Which modules of which layers a method adapts, with which rank and alpha: PEFT's matching rules on our modules
(`is_target`, `lora_layout -> {module: ModuleLoRA}`, `layer_scales`, `ia3_modules`).

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
from functools import lru_cache

import numpy as np

from jaxtune.config.method import MethodConfig
from jaxtune.config.model import SEPARATE_MODULES
from jaxtune.errors import JaxtuneError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
FUSED_HINT = " (Phi-3 fuses q, k and v into qkv_proj, gate and up into gate_up_proj: target those)"


def module_path(name: str, layer: int) -> str:
    """The transformers path of linear module `name` of `layer`, e.g. 'model.layers.3.self_attn.q_proj'."""
    return f"model.layers.{layer}.{'self_attn' if name in ATTENTION_MODULES else 'mlp'}.{name}"


def peft_module(name: str, layer: int) -> str:
    """The PEFT state-dict prefix of linear module `name` of `layer`: 'base_model.model.model.layers.3.mlp.up_proj'."""
    return f"base_model.model.{module_path(name, layer)}"


def peft_names(value):
    """A target/exclude field as PEFT's adapter_config.json writes it: a regex string, a list of names, or None."""
    return value if isinstance(value, str) else (list(value) or None)


@dataclass(frozen=True)
class ModuleLoRA:
    """One module's LoRA over the layers: `ranks[i]` (0: layer i not adapted) and `alphas[i]`."""

    ranks: tuple[int, ...]
    alphas: tuple[float, ...]
    rslora: bool

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def scales(self) -> np.ndarray:
        """[L] float64: alpha / r (rsLoRA: alpha / sqrt(r)) per layer, 0 where the layer is not adapted."""
        r = np.asarray(self.ranks, np.float64)
        denominator = np.sqrt(r) if self.rslora else r
        return np.where(r > 0, np.asarray(self.alphas) / np.maximum(denominator, 1), 0.0)

    @property
    def uniform(self) -> bool:
        return len(set(self.ranks)) == 1 and len(set(self.alphas)) == 1


def _names_match(names: tuple[str, ...], path: str) -> bool:
    return path in names or any(path.endswith("." + name) for name in names)


def _layer_of(path: str, layers_pattern: tuple[str, ...]) -> int | None:
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        match = next((m for p in layers_pattern if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", path))), None)
    return int(match.group("idx")) if match else None


def is_target(method: MethodConfig, path: str) -> bool:
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


def _pattern_value(patterns: tuple[tuple[str, float], ...], path: str, default):
    return next((value for key, value in patterns if re.match(rf"(.*\.)?({key})$", path)), default)


@lru_cache(maxsize=256)
def lora_layout(method: MethodConfig, num_layers: int, modules: tuple[str, ...] = SEPARATE_MODULES
                ) -> dict[str, ModuleLoRA]:
    """The modules `method` (lora or qlora) adapts on a model of `num_layers` layers whose layers hold `modules`
    (`ModelConfig.linear_modules`), in that order.

    An error names the method's fields when they select no module at all (PEFT's "Target modules ... not found").
    """
    layout = {}
    for name in modules:
        paths = [module_path(name, i) for i in range(num_layers)]
        ranks = tuple(int(_pattern_value(method.rank_pattern, p, method.rank)) if is_target(method, p) else 0
                      for p in paths)
        if any(ranks):
            alphas = tuple(float(_pattern_value(method.alpha_pattern, p, method.alpha)) if r else 0.0
                           for p, r in zip(paths, ranks))
            layout[name] = ModuleLoRA(ranks, alphas, method.rslora)
    if not layout and not method.target_parameters:
        raise JaxtuneError(f"target_modules={method.target_modules!r} (exclude_modules={method.exclude_modules!r}, "
                           f"layers_to_transform={method.layers_to_transform!r}) selects no module of a "
                           f"{num_layers}-layer model with modules {', '.join(modules)}; module paths look like "
                           f"{module_path(modules[0], 0)!r}" + FUSED_HINT * ("qkv_proj" in modules))
    return layout


def layer_scales(method: MethodConfig, num_layers: int, modules: tuple[str, ...] = SEPARATE_MODULES
                 ) -> float | dict[str, np.ndarray]:
    """The LoRA scale the forward multiplies by: one float when every adapted module and layer shares it (the
    common case: the compiled program is the plain one), else per module a [L] array (0 where not adapted).

    A layer that is not adapted needs no scale for LoRA (its zero `lora_a`/`lora_b` add nothing), but does for
    DoRA, whose magnitude would otherwise rescale it: scale 0 turns DoRA's m / ||W + s B A|| into 1 there.
    """
    layout = lora_layout(method, num_layers, modules)
    active = {float(s) for m in layout.values() for s, r in zip(m.scales, m.ranks) if r}
    skipped = any(0 in m.ranks for m in layout.values())
    if not active:  # experts alone (target_parameters): one rank and alpha everywhere
        return method.lora_scale
    if len(active) == 1 and not (method.dora and skipped):
        return active.pop()
    return {name: m.scales for name, m in layout.items()}


def ia3_modules(method: MethodConfig, num_layers: int, modules: tuple[str, ...] = SEPARATE_MODULES
                ) -> tuple[str, ...]:
    """The modules IA3 scales. IA3's vectors are stacked over all layers, so a module is adapted in every layer or
    in none; target fields that pick some layers of a module are refused, naming the module."""
    names = []
    for name in modules:
        hits = [is_target(method, module_path(name, i)) for i in range(num_layers)]
        if any(hits) and not all(hits):
            raise JaxtuneError(f"IA3 target_modules={method.target_modules!r} (layers_to_transform="
                               f"{method.layers_to_transform!r}) adapts {name} in layers "
                               f"{[i for i, h in enumerate(hits) if h]} only: jaxtune's IA3 scales a module in "
                               "every layer or in none")
        if all(hits):
            names.append(name)
    if not names:
        raise JaxtuneError(f"IA3 target_modules={method.target_modules!r} selects no module"
                           + FUSED_HINT * ("qkv_proj" in modules))
    return tuple(names)
