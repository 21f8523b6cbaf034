"""What the planner asks of a method's forward hooks: the predicates `linear.dense` asks of a layer's real leaves
(`DenseHook.fuses`, `DenseHook.needs_kernel`, `linear.folds_branch`), asked here of the method's abstract tree, so the
plan and the run cannot disagree about a kernel choice."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.methods.transform import apply_method
from jaxtune.models.linear import folds_branch
from jaxtune.models.params import LINEAR_AXES, abstract_params
from jaxtune.models.quant import full_shape
from jaxtune.parallel.rules import mesh_axes_of


@dataclass(frozen=True)
class HookFacts:
    """fused: the modules (per-layer shape [in, out], logical axes) whose hooks can fold their branch into the base
    product (`DenseHook.fuses`); whole_kernel: a hook needs the module's whole kernel (DoRA's norm): kernels are
    not used a piece at a time, and the branch's output is read beyond the residual add."""

    fused: tuple[tuple[tuple[int, int], tuple[str | None, str | None]], ...]
    whole_kernel: bool


@functools.lru_cache(maxsize=256)
def hook_facts(cfg: ModelConfig, method: MethodConfig) -> HookFacts:
    """`HookFacts` of `method`'s forward hooks on the modules of its abstract tree on `cfg` (nothing allocated)."""
    hooks = method.forward_of(cfg).dense
    if not hooks:
        return HookFacts((), False)
    tree = jax.eval_shape(lambda p, key: apply_method(p, cfg, method, key), abstract_params(cfg), jax.random.key(0))
    fused: list[tuple[tuple[int, int], tuple[str | None, str | None]]] = []
    whole = False
    for name, module in tree["layers"].items():
        if not isinstance(module, dict) or name not in LINEAR_AXES:
            continue
        present = [hook for hook in hooks if hook.trigger in module]
        whole = whole or any(hook.needs_kernel(module) for hook in present)
        if any(hook.product is not None and hook.fuses(module) for hook in present):
            d_in, d_out = full_shape(module["kernel"])[-2:]
            fused.append(((d_in, d_out), LINEAR_AXES[name]))
    return HookFacts(tuple(fused), whole)


def folds_everywhere(cfg: ModelConfig, method: MethodConfig, sizes: dict[str, int], platform: str) -> bool:
    """Whether every module whose hook can fold its branch does, on a mesh of `sizes` on `platform`
    (`linear.folds_branch`, as `dense` decides it for each)."""
    fused = hook_facts(cfg, method).fused
    return bool(fused) and all(folds_branch(platform, mesh_axes_of(axes, shape, sizes), gathered=sizes["context"] > 1)
                               for shape, axes in fused)
