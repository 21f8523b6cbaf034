"""IA3 (Liu et al. 2022): learned vectors scaling a module's output, or the input of MLP down projections.

Leaves `ia3_in` [L, in] on down_proj (a shared expert's too) and `ia3_out` [L, out] on other modules, ones at start;
a module is scaled in every layer or in none (`ia3_modules`). PEFT's tensors: `...{module}.ia3_l`, [out, 1]
or [1, in].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.config.method import AdapterForward, DenseHook
from jaxtune.config.model import hf_module_name
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import Method, PeftFormat, PlannerCosts
from jaxtune.methods.targets import FUSED_HINT, Targeted, is_target, module_path, peft_module, peft_names
from jaxtune.models.quant import full_shape

HOOKS = (DenseHook("ia3_in", scale_input=lambda x, module: x * module["ia3_in"].astype(x.dtype)),
         DenseHook("ia3_out", scale_output=lambda y, module: y * module["ia3_out"].astype(y.dtype)))


@dataclass(frozen=True, kw_only=True)
class IA3Config(Targeted):
    """IA3's options: which modules it scales (`Targeted`: PEFT's target_modules, exclude_modules,
    layers_to_transform, layers_pattern, modules_to_save). Default k_proj, v_proj, down_proj: the output of
    attention modules and the input of MLP down projections are scaled, as PEFT does."""

    kind: ClassVar[str] = "ia3"
    default_targets: ClassVar[tuple[str, ...]] = ("k_proj", "v_proj", "down_proj")

    def forward_of(self, cfg: ModelConfig) -> AdapterForward:
        return AdapterForward(dense=HOOKS)


def ia3_modules(method: IA3Config, stacks: tuple) -> tuple[str, ...]:
    """The modules IA3 scales. IA3's vectors are stacked over all layers, so a module is adapted in every layer or
    in none; target fields that pick some layers of a module are refused, naming the module."""
    names = []
    for name, layers in stacks:
        hits = [is_target(method, module_path(name, i)) for i in layers]
        if any(hits) and not all(hits):
            raise JaxtuneError(f"IA3 target_modules={method.target_modules!r} (layers_to_transform="
                               f"{method.layers_to_transform!r}) adapts {name} in layers "
                               f"{[i for i, h in zip(layers, hits) if h]} only: jaxtune's IA3 scales a module in "
                               "every layer or in none")
        if all(hits):
            names.append(name)
    if not names:
        raise JaxtuneError(f"IA3 target_modules={method.target_modules!r} selects no module"
                           + FUSED_HINT * any(name == "qkv_proj" for name, _ in stacks))
    return tuple(names)


def add_ia3(params: dict, cfg: ModelConfig, method: IA3Config, key: jax.Array) -> dict:
    """`params` with a vector of ones on every module `method` scales."""
    layers = dict(params["layers"])
    for name in ia3_modules(method, cfg.layer_stacks()):
        L, d_in, d_out = full_shape(layers[name]["kernel"])
        feedforward = hf_module_name(name).endswith("down_proj")  # a shared expert's too, a wide one
        leaf = {"ia3_in": jnp.ones((L, d_in))} if feedforward else {"ia3_out": jnp.ones((L, d_out))}
        layers[name] = {**layers[name], **leaf}
    return {**params, "layers": layers}


def _name(module: str, layer: int) -> str:
    return f"{peft_module(module, layer)}.ia3_l"


def _peft_config(cfg: ModelConfig, method: IA3Config) -> dict:
    targets = ia3_modules(method, cfg.layer_stacks())
    # PEFT wants feedforward_modules within a list of target_modules: the names that pick a down_proj
    named = targets if isinstance(method.target_modules, str) else method.target_modules
    return {"peft_type": "IA3", "target_modules": peft_names(method.target_modules),
            "exclude_modules": peft_names(method.exclude_modules),
            "feedforward_modules": [m for m in named if m.endswith("down_proj")], "fan_in_fan_out": False,
            "init_ia3_weights": True}


def _peft_tensors(params: dict, cfg: ModelConfig, method: IA3Config) -> dict[str, np.ndarray]:
    state = {}
    for name in ia3_modules(method, cfg.layer_stacks()):
        module = params["layers"][name]
        for row, i in enumerate(cfg.module_layers(name)):
            ia3 = (np.asarray(module["ia3_in"][row], np.float32)[None, :] if "ia3_in" in module
                   else np.asarray(module["ia3_out"][row], np.float32)[:, None])
            state[_name(name, i)] = np.ascontiguousarray(ia3)
    return state


def _method_of(config: dict, get, targets) -> IA3Config:
    method = IA3Config(target_modules=targets, exclude_modules=get("exclude_modules", ()),
                       modules_to_save=get("modules_to_save", ()))
    feedforward = get("feedforward_modules", [])
    feedforward = {feedforward} if isinstance(feedforward, str) else set(feedforward)
    scales_down = any(is_target(method, module_path(m, i)) for i in range(256)
                      for m in ("down_proj", "shared_expert.down_proj"))
    if {f.rsplit(".", 1)[-1] for f in feedforward} != ({"down_proj"} if scales_down else set()):
        raise JaxtuneError(f"IA3 feedforward_modules {sorted(feedforward)} are not supported (jaxtune scales the "
                           "input of down_proj and the output of other modules)")
    return method


def _peft_load(state: dict, params: dict, cfg: ModelConfig, method: IA3Config) -> dict:
    layers = dict(params["layers"])
    for name in ia3_modules(method, cfg.layer_stacks()):
        leaf = "ia3_in" if "ia3_in" in layers[name] else "ia3_out"
        value = np.stack([np.ravel(state[_name(name, i)]) for i in cfg.module_layers(name)])
        layers[name] = {**layers[name], leaf: jnp.asarray(value)}
    return {**params, "layers": layers}


def _saved(method, adapted, out_width, b, T, D) -> list:
    """The scaled modules' outputs (their vectors' gradient reads them); down_proj's input is kept as trained."""
    return [(f"{m} output", out_width[m], False) for m in adapted if m != "down_proj"]


IA3 = Method(
    kind="ia3",
    options=IA3Config,
    add_leaves=add_ia3,
    leaves=("ia3_in", "ia3_out"),
    module_axes={"ia3_in": lambda layers, d_in, d_out: (layers, d_in),
                 "ia3_out": lambda layers, d_in, d_out: (layers, d_out)},
    adapted=lambda method, stacks: dict.fromkeys(ia3_modules(method, stacks), 0),
    peft=PeftFormat(("IA3",), ("target_modules", "exclude_modules", "feedforward_modules", "modules_to_save"),
                    _peft_config, _peft_tensors, _method_of, _peft_load),
    costs=PlannerCosts(trains_input=lambda method, module, adapted: module == "down_proj" and module in adapted,
                       saved=_saved),
)
