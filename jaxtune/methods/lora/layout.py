"""Which modules of which layers LoRA adapts, with which rank and alpha: PEFT's rules on our modules
(`lora_layout -> {module: ModuleLoRA}`, `module_scales`; the target fields' own rules are
`methods.targets.is_target`).

After the target fields, PEFT takes rank_pattern and alpha_pattern per module path (`get_pattern_key`: the first key
whose regex `(.*\\.)?key$` matches the path). A module's `lora_a` [L, in, R] and `lora_b` [L, R, out] have its
largest rank R: a layer of rank r < R holds zeros beyond r (with zero gradients they stay zero under AdamW), and a
layer the adapter skips has rank 0 and scale 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.methods.targets import FUSED_HINT, Stacks, is_target, module_path

if TYPE_CHECKING:
    from jaxtune.methods.lora.options import LoRAConfig


@dataclass(frozen=True)
class ModuleLoRA:
    """One module's LoRA over the layers holding it (`layers`, its stack's rows): `ranks[i]` (0: layers[i] not
    adapted) and `alphas[i]`."""

    layers: tuple[int, ...]
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


def pattern_value(patterns: tuple[tuple[str, float], ...], path: str, default):
    r"""PEFT's `get_pattern_key`: the value of the first key whose regex `(.*\.)?key$` matches `path`."""
    return next((value for key, value in patterns if re.match(rf"(.*\.)?({key})$", path)), default)


@lru_cache(maxsize=256)
def lora_layout(method: LoRAConfig, stacks: Stacks) -> dict[str, ModuleLoRA]:
    """The modules `method` (lora or qlora) adapts among `stacks` ((module, the layers holding it), in order:
    `ModelConfig.layer_stacks`, or `uniform_stacks`).

    An error names the method's fields when they select no module at all (PEFT's "Target modules ... not found").
    """
    layout = {}
    for name, layers in stacks:
        paths = [module_path(name, i) for i in layers]
        ranks = tuple(int(pattern_value(method.rank_pattern, p, method.rank)) if is_target(method, p) else 0
                      for p in paths)
        if any(ranks):
            alphas = tuple(float(pattern_value(method.alpha_pattern, p, method.alpha)) if r else 0.0
                           for p, r in zip(paths, ranks))
            layout[name] = ModuleLoRA(layers, ranks, alphas, method.rslora)
    if not layout and not method.target_parameters:
        names = [name for name, _ in stacks]
        raise JaxtuneError(f"target_modules={method.target_modules!r} (exclude_modules={method.exclude_modules!r}, "
                           f"layers_to_transform={method.layers_to_transform!r}) selects no module of a "
                           f"{1 + max(max(layers, default=0) for _, layers in stacks)}-layer model with modules "
                           f"{', '.join(names)}; module paths look like {module_path(names[0], stacks[0][1][0])!r}"
                           + FUSED_HINT * ("qkv_proj" in names))
    return layout


def module_scales(method: LoRAConfig, name: str, layers: tuple[int, ...]) -> jnp.ndarray:
    """[len(layers)]: module `name`'s LoRA scale in each of `layers` (those holding it; 0 where not adapted), float32
    (float64 with x64)."""
    return jnp.asarray(lora_layout(method, ((name, layers),))[name].scales)
